"""Emulated FP8 linear: quantize exactly where TE does, in the recipe's formats and blocks.

Three GEMMs, each written as out = A @ B^T with both operands scaled along their last dim
(the contraction dim) and quantized with the role's granularity:

    fprop  y  [M, N] = x    [M, K] . W   [N, K]^T     A = input,       B = weight
    dgrad  dx [M, K] = dy   [M, N] . W^T [K, N]^T     A = grad_output, B = weight
    wgrad  dW [N, K] = dy^T [N, M] . x^T [K, M]^T     A = grad_output, B = input

So a 1 x 128 input block runs along K in fprop and along the tokens M in wgrad (TE's rowwise
and columnwise copies), a 128 x 128 weight tile serves both W and W^T, and a per-tensor scale is
computed once per tensor and reused by both of its GEMMs. Per-tensor and rowwise GEMMs run in
torch._scaled_mm on CPU; the others (and every GEMM on other devices) dequantize and matmul in
float32. Bias gradients come from the high-precision dy. No straight-through casts: the
gradient is never cast by autograd (that trap zeroes gradients), only by the dgrad/wgrad
quantization above.

Tensor parallelism: per-tensor amaxes of sharded operands and rowwise amaxes along a sharded
contraction dim are MAX-all-reduced over TP, so TP=2 computes what TP=1 does. 1 x 128, 128 x 128
and 1 x 32 groups never straddle shards when every shard's dims are multiples of the block;
otherwise the shard edge splits a group and TP > 1 differs from TP = 1 (legitimately).

FP4 recipes (nvfp4, mxfp4; fp4.py) quantize-dequantize each operand to float32 and matmul; nvfp4
applies the RHT to both wgrad operands along the token dim first, as TE does.
"""

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rl.fp8 import fp4
from megatron_rl.fp8.delayed import DelayedScalingState
from megatron_rl.fp8.formats import fp8_max
from megatron_rl.fp8.kernels import AmaxReducer
from megatron_rl.fp8.quantization import amax, dequantize, quantize
from megatron_rl.fp8.recipe import Fp8Recipe, OperandQuant
from megatron_rl.fp8.scales import scale_from_amax
from megatron_rl.fp8.switch import fp8_enabled

# Operands that are shards of a larger logical tensor, per Megatron parallel mode.
_SHARDED_ROLES = {None: (), "column": ("weight", "grad_output"), "row": ("weight", "input")}
# The GEMM whose contraction dim is split across TP ranks, per parallel mode.
_SHARDED_CONTRACTION = {None: None, "column": "dgrad", "row": "fprop"}


@dataclasses.dataclass(frozen=True)
class Fp8Plan:
    """Everything the autograd function needs besides tensors."""

    recipe: Fp8Recipe
    state: Optional[DelayedScalingState] = None
    # Delayed scaling: record amaxes and update scales in this pass (see delayed.py).
    update_history: bool = False
    # Activation recompute (delayed.py): None | "stash" (the checkpointed forward keeps its
    # forward scales) | "replay" (the recompute reuses them and records input/weight no more).
    recompute: Optional[str] = None
    # None (not sharded) | "column" | "row" (Megatron ColumnParallel / RowParallel).
    parallel_mode: Optional[str] = None
    # In-place MAX all-reduce over the tensor-parallel group (None at TP = 1).
    reduce_tp: Optional[AmaxReducer] = None
    # Delayed scaling's history reduction group (TE: TP x DP x CP), None for none.
    reduce_history: Optional[AmaxReducer] = None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               plan: Fp8Plan) -> torch.Tensor:
    """y = x W^T + b with FP8 emulation per `plan.recipe`; plain F.linear when FP8 is off.

    Args:
        x: [..., K] float32 / bfloat16 activations.
        weight: [N, K] (a TP shard under Megatron).
        bias: [N] or None.
        plan: recipe, delayed state and TP reductions.
    Returns:
        [..., N] in x.dtype.
    """
    if not (plan.recipe.enabled and fp8_enabled()):
        return F.linear(x, weight, bias)
    return _Fp8LinearFunction.apply(x, weight, bias, plan)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: Fp8Plan):
        x2 = x.reshape(-1, x.shape[-1])
        scale_x = _tensor_scale(plan, "input", x2)
        scale_w = _tensor_scale(plan, "weight", weight)
        y = _gemm(plan, "fprop", (x2, "input", scale_x), (weight, "weight", scale_w))
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.scale_x, ctx.scale_w = plan, scale_x, scale_w
        ctx.has_bias = bias is not None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        plan = ctx.plan
        dy = grad_y.reshape(-1, weight.shape[0])
        scale_g = _tensor_scale(plan, "grad_output", dy)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w_t = (weight.t(), "weight", ctx.scale_w)
            g = _gemm(plan, "dgrad", (dy, "grad_output", scale_g), w_t)
            grad_x = g.to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            x_t = (x2.t(), "input", ctx.scale_x)
            g = _gemm(plan, "wgrad", (dy.t(), "grad_output", scale_g), x_t)
            grad_w = g.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.sum(dim=0)
        return grad_x, grad_w, grad_b, None


def _tensor_scale(plan: Fp8Plan, role: str, t: torch.Tensor) -> Optional[torch.Tensor]:
    """Per-tensor recipes: the role's quantization scale (recording delayed amaxes); else None."""
    spec = plan.recipe.operand(role)
    if spec.granularity != "tensorwise":
        return None
    fmax = fp8_max(spec.fp8_dtype)
    local = amax(t)
    state = plan.state if spec.delayed else None
    if state is not None and plan.recompute == "replay" and role != "grad_output":
        return state.pop_stashed(role)
    if state is not None and state.has_scale(role):
        scale = state.scale_of(role)
    else:
        value = local.clone()
        if plan.reduce_tp is not None and role in _SHARDED_ROLES[plan.parallel_mode]:
            plan.reduce_tp(value)
        scale, _ = scale_from_amax(value, fmax, spec.power_2_scale)
    if state is not None and plan.update_history:
        value = local.clone()
        if plan.reduce_history is not None:
            plan.reduce_history(value)
        state.record(role, value, fmax)
    if state is not None and plan.recompute == "stash":
        state.stash(role, scale)
    return scale


def _gemm(plan: Fp8Plan, gemm: str, a: tuple, b: tuple) -> torch.Tensor:
    """A [M, K] @ B [N, K]^T in float32 from FP8 operands; a, b = (tensor, role, tensor_scale)."""
    if plan.recipe.operand(a[1]).is_fp4:
        return _gemm_fp4(plan, gemm, a, b)
    sharded_k = _SHARDED_CONTRACTION[plan.parallel_mode] == gemm
    qa, sa, spec_a = _quantize_operand(plan, a, sharded_k)
    qb, sb, spec_b = _quantize_operand(plan, b, sharded_k)
    if _scaled_mm_applies(qa, spec_a, spec_b):
        scale_b = sb if spec_b.granularity == "tensorwise" else sb.reshape(1, -1)
        return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=scale_b, out_dtype=torch.float32)
    deq_a = dequantize(qa, sa, spec_a.granularity, spec_a.block_size)
    deq_b = dequantize(qb, sb, spec_b.granularity, spec_b.block_size)
    return deq_a @ deq_b.t()


def _quantize_operand(plan: Fp8Plan, operand: tuple, sharded_k: bool):
    t, role, scale = operand
    spec = plan.recipe.operand(role)
    if spec.granularity == "tensorwise":
        q, s = quantize(t, "tensorwise", spec.fp8_dtype, scale=scale)
        return q, s, spec
    reducer = plan.reduce_tp if (sharded_k and spec.granularity == "rowwise") else None
    q, s = quantize(t, spec.granularity, spec.fp8_dtype, spec.block_size,
                    power_2_scale=spec.power_2_scale, amax_reducer=reducer)
    return q, s, spec


def _gemm_fp4(plan: Fp8Plan, gemm: str, a: tuple, b: tuple) -> torch.Tensor:
    """FP4 GEMM: fake-quantize both operands (RHT first in wgrad where the role asks), matmul fp32.

    The RHT pair cancels in the product ((A R)(B R)^T = A B^T); a contraction dim that is not a
    multiple of 16 is zero-padded first (zeros add nothing to the product; TE requires % 16).
    """
    (ta, role_a, _), (tb, role_b, _) = a, b
    spec_a, spec_b = plan.recipe.operand(role_a), plan.recipe.operand(role_b)
    if gemm == "wgrad" and spec_a.rht and spec_b.rht:
        pad = -ta.shape[-1] % fp4.NVFP4_BLOCK
        ta = fp4.random_hadamard_transform(F.pad(ta, (0, pad)))
        tb = fp4.random_hadamard_transform(F.pad(tb, (0, pad)))
    deq_a = _fake_quantize_fp4(plan, ta, role_a, spec_a)
    deq_b = _fake_quantize_fp4(plan, tb, role_b, spec_b)
    return deq_a @ deq_b.t()


def _fake_quantize_fp4(plan: Fp8Plan, t: torch.Tensor, role: str, spec: OperandQuant):
    """Quantize-dequantize one FP4 operand to float32. NVFP4's per-tensor global amax of a TP
    shard is MAX-reduced over TP (as tensorwise scales are), so TP = 2 computes what TP = 1 does."""
    if spec.granularity == "mxfp4":
        return fp4.mxfp4_dequantize(*fp4.mxfp4_quantize(t))
    reducer = plan.reduce_tp if role in _SHARDED_ROLES[plan.parallel_mode] else None
    tile_2d = spec.block_size == (16, 16)
    q, scale, global_amax = fp4.nvfp4_quantize(t, tile_2d, amax_reducer=reducer)
    return fp4.nvfp4_dequantize(q, scale, global_amax, tile_2d)


def _scaled_mm_applies(qa: torch.Tensor, spec_a: OperandQuant, spec_b: OperandQuant) -> bool:
    # torch._scaled_mm takes per-tensor or per-row scales; on CUDA it also needs dims that are
    # multiples of 16 and bf16 output for row scales, so only the CPU path uses it.
    per_row = ("tensorwise", "rowwise")
    same = spec_a.granularity == spec_b.granularity
    return qa.device.type == "cpu" and same and spec_a.granularity in per_row


class Fp8Linear(nn.Linear):
    """nn.Linear running the emulated FP8 GEMMs of `recipe` (high precision in fp8_disabled)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Fp8Recipe, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.fp8_state = make_delayed_state(recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.training and torch.is_grad_enabled()
        plan = Fp8Plan(self.recipe, self.fp8_state, update_history=update)
        return fp8_linear(x, self.weight, self.bias, plan)


def make_delayed_state(recipe: Fp8Recipe) -> Optional[DelayedScalingState]:
    """A DelayedScalingState for the delayed recipe, None otherwise."""
    if recipe.name != "delayed":
        return None
    return DelayedScalingState(recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin)
