"""Named reshape helpers between HF tensors and Megatron's fused tensors, and their TP layouts.

Megatron's fused QKV (weight [(nh + 2 ng) * d, hidden], bias [(nh + 2 ng) * d]) is grouped per
query group g: the hpg = nh / ng query heads of g, then k_g, then v_g. A plain [q; k; v] concat
is wrong and gives a large HF-parity error (ecosystem.md), which the parity tests catch.
`linear_fc1` holds the gate rows first, then the up rows.

TP layouts of a FULL tensor (the TP-independent tensor the name map speaks in):
- "column": rows split in tp contiguous chunks (embedding, output layer, fused QKV: whole query
  groups land on each rank because groups are contiguous);
- "row": columns split (linear_proj, linear_fc2);
- "gate_up": full = [gate; up], rank r holds [gate_r; up_r] (so a plain all-gather of the shards
  is NOT the full tensor);
- "replicated": every rank holds the full tensor (norms).
"""

from __future__ import annotations

import torch

from megatron_rl.models.hf_config import ModelSpec

LAYOUTS = ("column", "row", "gate_up", "replicated")


def identity(tensors: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    (tensor,) = tensors
    return tensor


def unwrap_one(full: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    return [full]


def fuse_qkv(tensors: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """[q, k, v] HF projections (weights or biases) -> Megatron's grouped fused QKV."""
    q, k, v = tensors
    d, ng, hpg = spec.head_dim, spec.num_query_groups, spec.heads_per_group
    _check_rows("q_proj", q, spec.num_attention_heads * d)
    _check_rows("k_proj", k, ng * d)
    _check_rows("v_proj", v, ng * d)
    rest = q.shape[1:]
    qg = q.reshape(ng, hpg * d, *rest)
    kg = k.reshape(ng, d, *rest)
    vg = v.reshape(ng, d, *rest)
    return torch.cat((qg, kg, vg), dim=1).reshape(-1, *rest)


def split_qkv(full: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """Inverse of `fuse_qkv`: grouped fused QKV -> [q, k, v] in HF layout."""
    d, ng, hpg = spec.head_dim, spec.num_query_groups, spec.heads_per_group
    _check_rows("linear_qkv", full, (spec.num_attention_heads + 2 * ng) * d)
    rest = full.shape[1:]
    grouped = full.reshape(ng, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def fuse_gate_up(tensors: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """[gate_proj, up_proj] -> linear_fc1 (gate rows, then up rows)."""
    gate, up = tensors
    _check_rows("gate_proj", gate, spec.ffn_hidden_size)
    _check_rows("up_proj", up, spec.ffn_hidden_size)
    return torch.cat((gate, up), dim=0)


def split_gate_up(full: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """Inverse of `fuse_gate_up`."""
    _check_rows("linear_fc1", full, 2 * spec.ffn_hidden_size)
    gate, up = torch.chunk(full, 2, dim=0)
    return [gate.contiguous(), up.contiguous()]


def _check_rows(name: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows, got shape {tuple(tensor.shape)}")


def shard_tensor(full: torch.Tensor, layout: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's TP shard of a full tensor (a contiguous copy)."""
    if layout == "replicated" or tp_size == 1:
        return full.contiguous()
    if layout == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat((gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]), 0)
    dim = _split_dim(layout)
    if full.shape[dim] % tp_size:
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} is not divisible by tp={tp_size}")
    return full.chunk(tp_size, dim)[tp_rank].contiguous()


def merge_shards(shards: list[torch.Tensor], layout: str) -> torch.Tensor:
    """Inverse of `shard_tensor` over all ranks' shards, in TP rank order."""
    if layout == "replicated" or len(shards) == 1:
        return shards[0]
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=_split_dim(layout))


def _split_dim(layout: str) -> int:
    if layout not in ("column", "row"):
        raise ValueError(f"unknown TP layout {layout!r}; known: {LAYOUTS}")
    return 0 if layout == "column" else 1
