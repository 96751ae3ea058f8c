"""Rollout-side FP8 W8A8 emulation: the numerics an SGLang FP8 server applies, in plain torch.

Two modes, matching the precision contract's `rollout_quant`:

- "blockwise" (fp8_blockwise, DeepSeek-V3 / SGLang `weight_block_size`): weights E4M3 with one
  float32 `weight_scale_inv` per bo x bi tile (default 128 x 128, HF FP8 checkpoint layout:
  `weight_scale_inv[i, j]` dequantizes `weight[i*bo:(i+1)*bo, j*bi:(j+1)*bi]`); activations
  quantized dynamically per token in 1 x bi groups along the hidden dim. scale_format "ue8m0"
  rounds every scale to a power of two (DeepGEMM / Blackwell layout), "fp32" keeps FP32 scales.
- "tensorwise" (fp8_tensorwise, SGLang per-tensor FP8): weights E4M3 with one float32
  `weight_scale` (a dequantization multiplier, SGLang's name for it); activations per-tensor,
  from a calibrated static `input_scale` when one is loaded, else dynamically from the current
  activation's amax (a documented simplification of static calibration).

The GEMM is emulated as dequantize-and-matmul in float32: the same products and fp32
accumulation an FP8 tensor-core kernel computes, up to summation order.
"""

from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from megatron_rl.fp8.formats import E4M3
from megatron_rl.fp8.quantization import dequantize, quantize

MODES = ("blockwise", "tensorwise")
SCALE_FORMATS = ("fp32", "ue8m0")
SkipSpec = Union[None, Callable[[str, nn.Module], bool], Iterable[str]]
_QUANT_BUFFERS = ("weight", "weight_scale_inv", "weight_scale", "input_scale")


def quantize_weight_blockwise(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128), scale_format: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to E4M3 with one scale per block (HF `weight_scale_inv` layout).

    Args:
        w: [out, in] float tensor.
        block_size: (bo, bi) tile; partial edge tiles are allowed.
        scale_format: "fp32" (scale_inv = amax / 448 up to an ulp) or "ue8m0" (power of two).
    Returns:
        (weight_fp8 float8_e4m3fn [out, in], weight_scale_inv float32 [ceil(out/bo), ceil(in/bi)]).
        All-zero tiles get scale_inv 1.
    """
    _check_choice("scale_format", scale_format, SCALE_FORMATS)
    if w.dim() != 2:
        raise ValueError(f"weight shape {tuple(w.shape)}: expected [out, in]")
    pow2 = scale_format == "ue8m0"
    return quantize(w, "block128x128", E4M3, tuple(block_size), power_2_scale=pow2)


def quantize_weight_tensorwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to E4M3 with one scale: (weight_fp8 [out, in], weight_scale float32 [])."""
    if w.dim() != 2:
        raise ValueError(f"weight shape {tuple(w.shape)}: expected [out, in]")
    return quantize(w, "tensorwise", E4M3)


class QuantizedLinear(nn.Module):
    """What the rollout's quantized linears share (W8A8Linear here, W4A4Linear in w4a4.py).

    Subclasses register their quantized buffers (named in `quant_buffers`) and the bias, and define
    `load_bf16`, `dequantized_weight` (cached in `_dequantized`) and `_fake_quant_input`. The GEMM
    is dequantize-and-matmul in float32: the same products and fp32 accumulation a low-precision
    tensor-core kernel computes, up to summation order.
    """

    quant_buffers: tuple[str, ...] = ()

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "QuantizedLinear":
        """Quantize an nn.Linear's weight (kw: the subclass's options); the bias keeps its dtype."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    dtype=linear.weight.dtype, device=linear.weight.device, **kw)
        layer.load_bf16(linear.weight.detach())
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        return layer

    def clear_cache(self) -> None:
        """Drop the cached dequantized weight (rebuilt by the next forward), e.g. to free memory."""
        self._dequantized = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] float -> [..., out] in x.dtype; activations fake-quantized first."""
        y = torch.matmul(self._fake_quant_input(x), self.dequantized_weight().t())
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts every floating buffer, low-precision ones included: a model-wide
        # .to(bf16) would silently turn `weight` into bf16 and round the fp32 scales. Keep the
        # quantized buffers in their dtypes (moving devices only); the bias follows the model.
        keep = {n: self._buffers[n] for n in self.quant_buffers if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for name, original in keep.items():
            moved = self._buffers[name]
            if moved.dtype != original.dtype:
                self._buffers[name] = original.to(moved.device)
        self.clear_cache()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        # load_state_dict copies into the buffers in place: drop the dequantized cache.
        self.clear_cache()
        super()._load_from_state_dict(*args, **kwargs)


def swap_linears(hf_model: nn.Module, skip: SkipSpec, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Replace every nn.Linear of `hf_model` not matched by `skip` with `make(linear)`, in place.

    skip: None (default_skip), a predicate (qualified_name, module) -> bool, or an iterable of
    substrings. Only nn.Linear is ever swapped, so embeddings and norms stay as they are.
    Returns hf_model itself.
    """
    should_skip = _skip_predicate(skip)
    targets = [(name, mod) for name, mod in hf_model.named_modules()
               if type(mod) is nn.Linear and not should_skip(name, mod)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = hf_model.get_submodule(parent_name) if parent_name else hf_model
        setattr(parent, child, make(linear))
    return hf_model


class W8A8Linear(QuantizedLinear):
    """nn.Linear replacement holding FP8 weights; forward quantizes activations dynamically.

    Buffers carry HF FP8 names, so `state_dict()` is the payload SGLang would load:
    blockwise: `weight` (E4M3 [out, in]) + `weight_scale_inv` (fp32 tile grid);
    tensorwise: `weight` + `weight_scale` (fp32 []) and optionally `input_scale` (fp32 []).
    """

    quant_buffers = _QUANT_BUFFERS

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        mode: str = "blockwise",
        block_size: tuple[int, int] = (128, 128),
        scale_format: str = "fp32",
        dtype: torch.dtype = torch.bfloat16,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        _check_choice("mode", mode, MODES)
        _check_choice("scale_format", scale_format, SCALE_FORMATS)
        self.in_features, self.out_features = in_features, out_features
        self.mode, self.scale_format = mode, scale_format
        self.block_size = (int(block_size[0]), int(block_size[1]))
        weight = torch.zeros(out_features, in_features, dtype=E4M3, device=device)
        self.register_buffer("weight", weight)
        if mode == "blockwise":
            grid = (-(-out_features // self.block_size[0]), -(-in_features // self.block_size[1]))
            self.register_buffer("weight_scale_inv", torch.ones(grid, device=device))
        else:
            self.register_buffer("weight_scale", torch.ones((), device=device))
            self.register_buffer("input_scale", None)
        bias_t = torch.zeros(out_features, dtype=dtype, device=device) if bias else None
        self.register_buffer("bias", bias_t)
        self._dequantized: Optional[torch.Tensor] = None

    @classmethod
    def from_quantized(cls, weight_fp8: torch.Tensor, scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, **kw) -> "W8A8Linear":
        """Wrap already-quantized tensors (`scale` is weight_scale_inv or weight_scale by mode)."""
        out_features, in_features = weight_fp8.shape
        dtype = kw.pop("dtype", bias.dtype if bias is not None else torch.bfloat16)
        layer = cls(in_features, out_features, bias is not None, dtype=dtype,
                    device=weight_fp8.device, **kw)
        layer.load_fp8(weight_fp8, scale)
        if bias is not None:
            layer.bias.copy_(bias)
        return layer

    @torch.no_grad()
    def load_fp8(self, weight_fp8: torch.Tensor, weight_scale_inv: torch.Tensor) -> None:
        """Load FP8 weights as shipped by weight sync (tensorwise: the scale is `weight_scale`)."""
        if weight_fp8.shape != self.weight.shape or weight_fp8.dtype != E4M3:
            raise ValueError(f"weight {tuple(weight_fp8.shape)} {weight_fp8.dtype}: expected "
                             f"{tuple(self.weight.shape)} {E4M3}")
        target = self.weight_scale_inv if self.mode == "blockwise" else self.weight_scale
        if weight_scale_inv.shape != target.shape:
            name = "weight_scale_inv" if self.mode == "blockwise" else "weight_scale"
            raise ValueError(f"{name} shape {tuple(weight_scale_inv.shape)}: expected "
                             f"{tuple(target.shape)} for block_size={self.block_size}")
        self.weight.copy_(weight_fp8)
        target.copy_(weight_scale_inv.float())
        self.clear_cache()

    @torch.no_grad()
    def load_bf16(self, weight: torch.Tensor) -> None:
        """Quantize a high-precision [out, in] weight into this layer."""
        if self.mode == "blockwise":
            self.load_fp8(*quantize_weight_blockwise(weight, self.block_size, self.scale_format))
        else:
            self.load_fp8(*quantize_weight_tensorwise(weight))

    @torch.no_grad()
    def set_input_scale(self, input_scale: Optional[torch.Tensor]) -> None:
        """tensorwise: a calibrated static activation scale (dequant multiplier), or None."""
        if self.mode != "tensorwise":
            raise ValueError("input_scale is only used by mode='tensorwise'")
        self.input_scale = None if input_scale is None else input_scale.detach().float().reshape(())

    def dequantized_weight(self) -> torch.Tensor:
        """The FP8 weight dequantized to float32 [out, in], cached until the next load."""
        if self._dequantized is None or self._dequantized.device != self.weight.device:
            if self.mode == "blockwise":
                w = dequantize(self.weight, self.weight_scale_inv, "block128x128", self.block_size)
            else:
                w = dequantize(self.weight, self.weight_scale, "tensorwise")
            self._dequantized = w
        return self._dequantized

    def _fake_quant_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "blockwise":
            q, s = quantize_activation_groups(x, self.block_size[1], self.scale_format)
            return _dequantize_groups(q, s, self.block_size[1])
        scale = None if self.input_scale is None else torch.reciprocal(self.input_scale)
        q, s = quantize(x, "tensorwise", E4M3, scale=scale)
        return dequantize(q, s, "tensorwise")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"mode={self.mode}, block_size={self.block_size}, scale_format={self.scale_format}")


def quantize_activation_groups(x: torch.Tensor, group: int, scale_format: str = "fp32"
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's dynamic per-token-group activation quantizer, arithmetic for arithmetic.

    sglang 0.5.23 kernels/jit/csrc/gemm/per_token_group_quant.cuh:405-420: amax floored at 1e-10,
    scale_inv = amax * float32(1/448) (what the GEMM multiplies by), q = sat(x * (448 / amax)); UE8M0:
    scale_inv = 2^ceil(log2(amax / 448)), q = sat(x / scale_inv). SGLang asserts K % group == 0
    (kernels/ops/quantization/fp8_kernel.py:502) and the SGLang build path refuses such models; here a
    ragged last group is zero-padded (its amax over the elements that exist).

    Args:
        x: [..., K] float activations. group: elements per group (block_size[1]).
    Returns:
        q [..., K] float8_e4m3fn and scale_inv [..., ceil(K / group)] float32.
    """
    xf = x.float()
    k = xf.shape[-1]
    pad = -k % group
    groups = torch.nn.functional.pad(xf, (0, pad)).reshape(*xf.shape[:-1], -1, group)
    amax = groups.abs().amax(dim=-1).clamp_min(1e-10)
    fp8_max = torch.finfo(E4M3).max
    if scale_format == "ue8m0":
        scale_inv = torch.exp2(torch.ceil(torch.log2(amax * torch.tensor(1.0 / fp8_max))))
        quant_scale = torch.reciprocal(scale_inv)
    else:
        scale_inv = amax * torch.tensor(1.0 / fp8_max, dtype=torch.float32)
        quant_scale = torch.div(torch.full_like(amax, fp8_max), amax)
    q = (groups * quant_scale.unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(E4M3)
    return q.reshape(*xf.shape[:-1], -1)[..., :k], scale_inv


def _dequantize_groups(q: torch.Tensor, scale_inv: torch.Tensor, group: int) -> torch.Tensor:
    k = q.shape[-1]
    return (q.float() * scale_inv.repeat_interleave(group, dim=-1)[..., :k])


def default_skip(name: str, module: nn.Module) -> bool:
    """High-precision tensors of the contract: lm_head, embeddings, norms, MoE routers."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("lm_head", "gate", "router") or "embed" in name or "norm" in leaf


def quantize_model_w8a8(
    hf_model: nn.Module,
    block_size: tuple[int, int] = (128, 128),
    scale_format: str = "fp32",
    skip: SkipSpec = None,
    mode: str = "blockwise",
) -> nn.Module:
    """Swap every nn.Linear of an HF transformers model for a W8A8Linear, in place.

    Args:
        hf_model: any nn.Module (typically an HF CausalLM).
        block_size, scale_format, mode: as for W8A8Linear.
        skip: None (default_skip), a predicate (qualified_name, module) -> bool, or an iterable of
            substrings; a matching nn.Linear stays high precision. Only nn.Linear is ever swapped,
            so embeddings and norms stay as they are; lm_head is skipped by default.
    Returns:
        hf_model itself.
    """
    return swap_linears(hf_model, skip, lambda linear: W8A8Linear.from_linear(
        linear, mode=mode, block_size=block_size, scale_format=scale_format))


def _skip_predicate(skip: SkipSpec) -> Callable[[str, nn.Module], bool]:
    if skip is None:
        return default_skip
    if callable(skip):
        return skip
    if isinstance(skip, str):
        raise ValueError(f"skip={skip!r}: pass a list of name substrings, not a string")
    patterns = tuple(skip)
    return lambda name, module: any(p in name for p in patterns)


def _check_choice(key: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} is not one of {choices}")
