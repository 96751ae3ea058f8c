"""Load HF tensors into the actor's TP/PP shards and export them back as full HF-named tensors."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.actor.forward import unwrap_model
from megatron_rl.actor.parallel import ParallelInfo
from megatron_rl.models import name_map
from megatron_rl.models.hf_config import ModelSpec


def global_params(model_chunks: list[torch.nn.Module],
                  layer_offset: int) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by canonical (local-spec) name with GLOBAL layer numbers."""
    out = {}
    for chunk in model_chunks:
        for name, param in unwrap_model(chunk).named_parameters():
            out[name_map.to_global_layer_name(name_map.canonical_name(name), layer_offset)] = param
    return out


@torch.no_grad()
def load_hf_tensors(params: dict[str, torch.nn.Parameter], named_tensors: Iterable[tuple[str, torch.Tensor]],
                    spec: ModelSpec, parallel: ParallelInfo) -> None:
    """Copy HF tensors into the parameters (sharded for this TP rank); every parameter must be set.

    Raises ValueError naming a missing, unexpected or wrongly shaped tensor.
    """
    conv = name_map.HFToMegatron(spec, parallel.tp_rank, parallel.tp_size, wanted=params)
    for hf_name, tensor in named_tensors:
        for megatron_name, shard in conv.add(hf_name, tensor):
            param = params[megatron_name]
            if shard.shape != param.shape:
                raise ValueError(f"{megatron_name} (from {hf_name!r}) has shard shape "
                                 f"{tuple(shard.shape)}, the model expects {tuple(param.shape)}")
            param.copy_(shard)
    conv.check_complete()


def needed_hf_names(params: dict[str, torch.nn.Parameter], spec: ModelSpec) -> list[str]:
    """HF tensor names this rank's parameters are built from (one PP stage's slice of the file)."""
    return name_map.HFToMegatron(spec, wanted=params).sources()


def _gather_tp(name: str, shard: torch.Tensor, parallel: ParallelInfo) -> torch.Tensor:
    """The full tensor from all TP ranks' shards (all-gather over the TP group)."""
    layout = name_map.tp_layout(name)
    if layout == "replicated" or parallel.tp_size == 1:
        return shard.clone()
    shards = [torch.empty_like(shard) for _ in range(parallel.tp_size)]
    # TP group: every TP rank of this stage walks the same parameters in the same order.
    dist.all_gather(shards, shard.contiguous(), group=parallel.tp_group)
    return name_map.merge_tp_shards(name, shards)


@torch.no_grad()
def export_hf_tensors(params: dict[str, torch.nn.Parameter], spec: ModelSpec,
                      parallel: ParallelInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors of this PP stage, one parameter at a time (peak extra memory about one
    gathered parameter). Every TP rank must drain the iterator (the all-gathers are collective)."""
    for name, param in params.items():
        full = _gather_tp(name, param.detach(), parallel)
        yield from name_map.megatron_to_hf(name, full, spec)
