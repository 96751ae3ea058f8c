"""Megatron-Core tensor-parallel linears running the emulated FP8 GEMMs, and the layer-spec swap.

Megatron's FP8 exists only through Transformer Engine; with the local (non-TE) spec its `fp8=`
setting silently does nothing. These subclasses of ColumnParallelLinear / RowParallelLinear
override `_forward_impl` (the GEMM) and keep everything around it (TP regions, gather_output,
the output all-reduce, bias handling, sharded checkpoints). `apply_fp8_to_layer_spec` swaps them
into linear_qkv, linear_proj, linear_fc1 and linear_fc2 of a local GPT layer spec; embedding,
output layer and norms are not touched (the contract's `high_precision` tensors).

Inside `megatron_rl.fp8.fp8_disabled()` (the BF16 shadow) and for the bf16 recipe the parent's
own `_forward_impl` runs, so the shadow is bitwise the plain Megatron model, same parameters.
The delayed recipe adds a `fp8_state` submodule whose buffers ride in state_dict and in
Megatron's sharded_state_dict (replicated across TP: its amaxes are all-reduced).
"""

import copy
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_rl.fp8.linear import Fp8Plan, fp8_linear, make_delayed_state
from megatron_rl.fp8.recipe import Fp8Recipe
from megatron_rl.fp8.switch import fp8_enabled

FP8_LINEAR_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class _Fp8ParallelLinearMixin:
    """State and plan shared by the column- and row-parallel FP8 linears."""

    fp8_parallel_mode: str

    def __init__(self, *args, fp8_recipe: Fp8Recipe, **kwargs):
        super().__init__(*args, **kwargs)  # the Megatron parallel linear next in the MRO
        self._init_fp8(fp8_recipe)

    def _init_fp8(self, fp8_recipe: Fp8Recipe) -> None:
        if not isinstance(fp8_recipe, Fp8Recipe):
            raise ValueError(f"fp8_recipe={fp8_recipe!r} is not an Fp8Recipe")
        if self.is_expert:
            raise ValueError("emulated FP8 linears do not support MoE expert layers")
        self.fp8_recipe = fp8_recipe
        self.fp8_state = make_delayed_state(fp8_recipe)

    def _fp8_active(self) -> bool:
        return self.fp8_recipe.enabled and fp8_enabled()

    def _fp8_plan(self) -> Fp8Plan:
        # Amax collectives: per-tensor / rowwise scales over the TP group (so TP=2 equals TP=1);
        # delayed histories over TE's amax group (TP x DP x CP), which keeps every replica's
        # scales identical, as Megatron + TE do.
        history = None
        if self.fp8_state is not None:
            history = _max_reducer(_amax_reduction_group(self.config, self.tp_group))
        # Inside Megatron's activation checkpoint (tensor_parallel/random.py:496-570) the
        # original forward runs without grad and the recompute in backward with it.
        checkpointing = self.training and is_checkpointing()
        grad = torch.is_grad_enabled()
        return Fp8Plan(
            recipe=self.fp8_recipe,
            state=self.fp8_state,
            update_history=self.training and (grad or checkpointing),
            recompute=("replay" if grad else "stash") if checkpointing else None,
            parallel_mode=self.fp8_parallel_mode,
            reduce_tp=_max_reducer(self.tp_group),
            reduce_history=history,
        )


class Fp8ColumnParallelLinear(_Fp8ParallelLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear (weight [out/tp, in]) with emulated FP8 GEMMs."""

    fp8_parallel_mode = "column"

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self._fp8_active():
            return super()._forward_impl(input, weight, *args, **kwargs)
        group = kwargs["tp_group"]
        # The parent's GEMM function also runs these TP communications; ours must do them here.
        if kwargs["sequence_parallel"]:
            input = gather_from_sequence_parallel_region(input, True, group=group)
        elif kwargs["allreduce_dgrad"]:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        return fp8_linear(input, weight, kwargs["bias"], self._fp8_plan())


class Fp8RowParallelLinear(_Fp8ParallelLinearMixin, RowParallelLinear):
    """RowParallelLinear (weight [out, in/tp]) with emulated FP8 GEMMs."""

    fp8_parallel_mode = "row"

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self._fp8_active():
            return super()._forward_impl(input, weight, *args, **kwargs)
        # RowParallelLinear passes bias=None here and adds it after the output all-reduce.
        return fp8_linear(input, weight, kwargs["bias"], self._fp8_plan())


def apply_fp8_to_layer_spec(layer_spec: ModuleSpec, recipe: Fp8Recipe) -> ModuleSpec:
    """A copy of a local GPT layer spec whose QKV, output projection, fc1 and fc2 run FP8.

    Args:
        layer_spec: e.g. get_gpt_layer_local_spec(...): linear_qkv / linear_fc1 must be
            ColumnParallelLinear and linear_proj / linear_fc2 RowParallelLinear.
        recipe: the training recipe; bf16 returns an unchanged copy.
    Returns:
        A deep copy of layer_spec (the input is not modified).
    """
    if not isinstance(recipe, Fp8Recipe):
        raise ValueError(f"recipe={recipe!r} is not an Fp8Recipe")
    spec = copy.deepcopy(layer_spec)
    if not recipe.enabled:
        return spec
    attention = spec.submodules.self_attention.submodules
    mlp = spec.submodules.mlp.submodules
    if not hasattr(mlp, "linear_fc1"):
        raise ValueError("apply_fp8_to_layer_spec supports dense MLP layer specs (no MoE)")
    _swap(attention, "linear_qkv", ColumnParallelLinear, Fp8ColumnParallelLinear, recipe)
    _swap(attention, "linear_proj", RowParallelLinear, Fp8RowParallelLinear, recipe)
    _swap(mlp, "linear_fc1", ColumnParallelLinear, Fp8ColumnParallelLinear, recipe)
    _swap(mlp, "linear_fc2", RowParallelLinear, Fp8RowParallelLinear, recipe)
    return spec


def _swap(submodules, name: str, expected: type, fp8_cls: type, recipe: Fp8Recipe) -> None:
    current = getattr(submodules, name)
    module = current.module if isinstance(current, ModuleSpec) else current
    if module is not expected:
        raise ValueError(f"{name} is {getattr(module, '__name__', module)}, expected "
                         f"{expected.__name__} (a local, non-TE layer spec)")
    params = dict(current.params) if isinstance(current, ModuleSpec) else {}
    setattr(submodules, name, ModuleSpec(module=fp8_cls, params={**params, "fp8_recipe": recipe}))


def _max_reducer(group) -> Optional[Callable[[torch.Tensor], None]]:
    """In-place MAX all-reduce over `group`; None when the group has one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def _amax_reduction_group(config, tp_group):
    """TE's amax group (TP x DP x CP; TP x CP with tp_only_amax_red) once parallel_state is up."""
    if not parallel_state.model_parallel_is_initialized():
        return tp_group
    # ModelParallelConfig (not TransformerConfig) has no tp_only_amax_red field.
    tp_only = getattr(config, "tp_only_amax_red", False)
    return parallel_state.get_amax_reduction_group(with_context_parallel=True,
                                                   tp_only_amax_red=tp_only)
