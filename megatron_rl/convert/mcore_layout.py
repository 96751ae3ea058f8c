"""Where each Megatron parameter lives in a Megatron-Core torch_dist checkpoint, from the name map.

Megatron-Core 0.16 `GPTModel.sharded_state_dict()` (default metadata) stores, for any TP/PP:
- a non-layer parameter under its own name, global shape = the full (TP-merged) tensor;
- a decoder-layer parameter `decoder.layers.{i}.X` under ONE key `decoder.layers.X` whose global
  shape is [num_layers, *full]: layer i is the slice [i] (a prepended "layer axis");
- norms under their Transformer-Engine spelling even with the local spec
  (`input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`; name_map.te_name);
- linear_fc1's global tensor as [gate; up], written as per-TP-rank gate and up chunks;
- one ShardedObject per linear module and layer, `decoder.layers.M._extra_state/shard_{i}_{L}`,
  holding `torch.save([None])` for the local spec (FP8 metadata for TE);
- the tied output layer not at all (it is stored as the embedding).
Checked against a real GPTModel in tests/unit/test_convert_megatron.py. With
`metadata={"non_homogeneous_layers": True}` Megatron keys layers as `decoder.layers.{i}.X`
without the layer axis; `locate` reads that spelling too.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import torch

from megatron_rl.models import name_map
from megatron_rl.models.hf_config import ModelSpec

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a sub-block of a global tensor."""
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor the model has (name-map names, plus lm_head when tied: absent)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    by_suffix = {
        "embed_tokens.weight": (spec.vocab_size, h), "lm_head.weight": (spec.vocab_size, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "o_proj.weight": (h, q), "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
        "layernorm.weight": (h,), "norm.weight": (h,),
    }
    shapes = {}
    for name in name_map.hf_names(spec):
        suffix = next(s for s in by_suffix if name.endswith(s))
        shapes[name] = by_suffix[suffix]
    return shapes


def exported_megatron_names(spec: ModelSpec) -> list[str]:
    """Global-layer Megatron names stored in a checkpoint (the tied output layer is not)."""
    return [n for n in name_map.megatron_names(spec) if name_map.match_megatron(n, spec)[0].exported]


def hf_sources(megatron_name: str, spec: ModelSpec) -> list[str]:
    """The HF tensor names one Megatron parameter is built from."""
    rule, fields = name_map.match_megatron(megatron_name, spec)
    return [pattern.format(**fields) for pattern in rule.hf]


def full_shape(megatron_name: str, spec: ModelSpec,
               hf_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """Shape of the full Megatron tensor, by running the rule's reshape on meta tensors.

    Raises ValueError naming the HF tensors when their shapes cannot be fused.
    """
    shapes = hf_shapes or expected_hf_shapes(spec)
    rule, _ = name_map.match_megatron(megatron_name, spec)
    sources = hf_sources(megatron_name, spec)
    metas = [torch.empty(shapes[s], device="meta") for s in sources]
    try:
        return tuple(rule.to_megatron(metas, spec).shape)
    except (ValueError, RuntimeError) as err:
        found = {s: tuple(shapes[s]) for s in sources}
        raise ValueError(f"cannot build {megatron_name} from {found}: {err}") from err


def checkpoint_key(megatron_name: str) -> tuple[str, int | None]:
    """(torch_dist key, layer index or None) of a canonical, global-layer Megatron name."""
    te = name_map.te_name(megatron_name)
    layer = name_map.layer_number(te)
    if layer is None:
        return te, None
    return _LAYER_KEY.sub("decoder.layers.", te), layer


@dataclass(frozen=True)
class StoredTensor:
    """One Megatron parameter as stored: key, layer slot and the TP-merged (full) shape."""

    megatron_name: str
    key: str
    layer: int | None
    full_shape: tuple[int, ...]
    num_layers: int

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.full_shape if self.layer is None else (self.num_layers, *self.full_shape)

    def to_global(self, box: Box) -> Box:
        """A box in full-tensor coordinates -> global coordinates (prepends the layer axis)."""
        if self.layer is None:
            return box
        return (self.layer, *box[0]), (1, *box[1])


def stored_tensors(spec: ModelSpec, hf_shapes: dict[str, tuple[int, ...]] | None = None) -> list[StoredTensor]:
    """Every stored parameter, layer-major (embedding, layer 0, ..., final norm, output layer)."""
    out = []
    for name in exported_megatron_names(spec):
        key, layer = checkpoint_key(name)
        out.append(StoredTensor(name, key, layer, full_shape(name, spec, hf_shapes), spec.num_layers))
    return sorted(out, key=_layer_major)


def _layer_major(t: StoredTensor) -> tuple[int, int]:
    if t.layer is not None:
        return (1, t.layer)
    return (0 if t.megatron_name.startswith("embedding.") else 2, 0)


def tp_chunks(tensor: StoredTensor, tp: int) -> list[Box]:
    """The boxes (full-tensor coordinates) Megatron writes for this tensor at TP size `tp`."""
    shape = tensor.full_shape
    layout = name_map.tp_layout(tensor.megatron_name)
    if layout == "gate_up":  # per rank: its gate rows, then its up rows (even at tp=1)
        half = shape[0] // 2
        if half % tp:
            raise ValueError(f"{tensor.megatron_name}: {half} gate rows are not divisible by tp={tp}")
        rows = half // tp
        rest = tuple(shape[1:])
        return [((part * half + r * rows, *(0,) * len(rest)), (rows, *rest))
                for r in range(tp) for part in (0, 1)]
    if layout == "replicated" or tp == 1:
        return [((0,) * len(shape), shape)]
    dim = 0 if layout == "column" else 1
    if shape[dim] % tp:
        raise ValueError(f"{tensor.megatron_name}: dim {dim} of {shape} is not divisible by tp={tp}")
    step = shape[dim] // tp
    boxes = []
    for r in range(tp):
        offsets, sizes = [0] * len(shape), list(shape)
        offsets[dim], sizes[dim] = r * step, step
        boxes.append((tuple(offsets), tuple(sizes)))
    return boxes


def extra_state_keys(spec: ModelSpec) -> list[str]:
    """Unique keys of the per-layer `_extra_state` objects of the linear modules."""
    modules = []
    for rule in name_map.rules_for(spec):
        if "{layer}" in rule.megatron and rule.layout != "replicated":
            module = rule.megatron.rsplit(".", 1)[0].replace("decoder.layers.{layer}.", "")
            if module not in modules:
                modules.append(module)
    n = spec.num_layers
    return [f"decoder.layers.{m}._extra_state/shard_{i}_{n}" for i in range(n) for m in modules]


def empty_extra_state() -> bytes:
    """What Megatron stores for a local-spec linear's extra state (a list holding None)."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def locate(tensor: StoredTensor, keys: dict[str, tuple[int, ...]]) -> tuple[str, Box]:
    """(key, global box) of one layer's (or a non-layer) full tensor in a checkpoint.

    `keys` maps the checkpoint's tensor keys to global shapes. Raises ValueError naming the key
    when the parameter is absent or its stored shape disagrees with the model config.
    """
    full = ((0,) * len(tensor.full_shape), tensor.full_shape)
    if tensor.key in keys:
        box = tensor.to_global(full)
        expected = tensor.global_shape
        found = keys[tensor.key]
    else:
        per_layer = name_map.te_name(tensor.megatron_name)
        if tensor.layer is None or per_layer not in keys:
            raise ValueError(f"the checkpoint has no {tensor.key!r} (parameter {tensor.megatron_name})")
        return _checked(per_layer, keys[per_layer], tensor.full_shape, full)
    return _checked(tensor.key, found, expected, box)


def _checked(key: str, found: tuple[int, ...], expected: tuple[int, ...], box: Box) -> tuple[str, Box]:
    if tuple(found) != tuple(expected):
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(found)}, the model config "
                         f"implies {tuple(expected)}")
    return key, box
