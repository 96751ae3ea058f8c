"""Declarative HF <-> Megatron-Core name map for dense Llama 3.x / Qwen2 / Qwen3, plus TP and PP helpers.

One rule per Megatron parameter: its name pattern, the HF tensors it is built from, the named
reshape helpers both ways and its TP layout. Patterns carry `{layer}` (global layer number); an
MoE family adds rules with an `{expert}` placeholder and an "expert" layout, not new branches.
Megatron names are the local-spec ones (`input_layernorm`, `pre_mlp_layernorm`); the TE spec
fuses those norms into the next linear, and `canonical_name` / `te_name` translate.

Used by the actor (load and export), the weight sync and tools/convert_*.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from megatron_rl.models import reshape
from megatron_rl.models.hf_config import ModelSpec

ToMegatron = Callable[[list[torch.Tensor], ModelSpec], torch.Tensor]
ToHF = Callable[[torch.Tensor, ModelSpec], list[torch.Tensor]]


def _always(spec: ModelSpec) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    layout: str = "replicated"
    to_megatron: ToMegatron = reshape.identity
    to_hf: ToHF = reshape.unwrap_one
    when: Callable[[ModelSpec], bool] = _always
    exported: bool = True
    """False for a parameter that duplicates another one's HF tensor (tied output layer)."""


_L, _H = "decoder.layers.{layer}.", "model.layers.{layer}."
_ATTN = _H + "self_attn."
RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column"),
    Rule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",)),
    Rule(_L + "self_attention.linear_qkv.weight",
         (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"),
         "column", reshape.fuse_qkv, reshape.split_qkv),
    Rule(_L + "self_attention.linear_qkv.bias",
         (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"),
         "column", reshape.fuse_qkv, reshape.split_qkv, when=lambda s: s.qkv_bias),
    Rule(_L + "self_attention.q_layernorm.weight", (_ATTN + "q_norm.weight",),
         when=lambda s: s.qk_norm),
    Rule(_L + "self_attention.k_layernorm.weight", (_ATTN + "k_norm.weight",),
         when=lambda s: s.qk_norm),
    Rule(_L + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), "row"),
    Rule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",)),
    Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
         "gate_up", reshape.fuse_gate_up, reshape.split_gate_up),
    Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "row"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), "column",
         when=lambda s: not s.tie_word_embeddings),
    # Tied: the last PP stage keeps its own copy of the embedding (Megatron syncs their grads).
    Rule("output_layer.weight", ("model.embed_tokens.weight",), "column",
         when=lambda s: s.tie_word_embeddings, exported=False),
)

# HF tensors that carry no parameter (buffers some checkpoints saved).
IGNORED_HF = (re.compile(r".*\.rotary_emb\.inv_freq$"),)

# Local-spec name -> TE-spec name (TE fuses the pre-norms into the following linear).
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def _regex(pattern: str) -> re.Pattern:
    body = re.escape(pattern).replace(r"\{layer\}", r"(?P<layer>\d+)")
    return re.compile(f"^{body}$")


_MEGATRON_RE = {rule.megatron: _regex(rule.megatron) for rule in RULES}


def rules_for(spec: ModelSpec) -> list[Rule]:
    """The rules that apply to this model (QKV bias, QK norm and tying are per-model)."""
    return [rule for rule in RULES if rule.when(spec)]


def match_megatron(name: str, spec: ModelSpec | None = None) -> tuple[Rule, dict[str, str]]:
    """The rule and placeholder values for a (canonical, global-layer) Megatron name.

    With spec None, any rule of the table with that pattern (enough for layouts).
    """
    name = canonical_name(name)
    for rule in rules_for(spec) if spec is not None else RULES:
        found = _MEGATRON_RE[rule.megatron].match(name)
        if found:
            return rule, found.groupdict()
    raise ValueError(f"no name-map rule for Megatron parameter {name!r}")


def tp_layout(megatron_name: str) -> str:
    """"column" | "row" | "gate_up" | "replicated" (see models/reshape.py)."""
    return match_megatron(megatron_name)[0].layout


def partition_dim(megatron_name: str) -> int | None:
    """The dim TP shards are split along (gate_up shards are split per half, see merge_tp_shards)."""
    return {"column": 0, "gate_up": 0, "row": 1, "replicated": None}[tp_layout(megatron_name)]


def shard_for_tp(megatron_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP shard of a full Megatron tensor for rank tp_rank."""
    return reshape.shard_tensor(full, tp_layout(megatron_name), tp_rank, tp_size)


def merge_tp_shards(megatron_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Full Megatron tensor from all TP ranks' shards (in TP rank order)."""
    return reshape.merge_shards(shards, tp_layout(megatron_name))


def megatron_to_hf(megatron_name: str, full_tensor: torch.Tensor,
                   spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one FULL (TP-merged) Megatron tensor with a GLOBAL layer number.

    Returns [] for a parameter that is not exported (the tied output layer).
    """
    rule, fields = match_megatron(megatron_name, spec)
    if not rule.exported:
        return []
    tensors = rule.to_hf(full_tensor, spec)
    return [(pattern.format(**fields), t) for pattern, t in zip(rule.hf, tensors)]


def megatron_names(spec: ModelSpec, layers: Iterable[int] | None = None,
                   first_stage: bool = True, last_stage: bool = True) -> list[str]:
    """Global-layer Megatron parameter names of a PP stage (default: the whole model)."""
    layers = range(spec.num_layers) if layers is None else layers
    names = []
    for rule in rules_for(spec):
        if "{layer}" in rule.megatron:
            names += [rule.megatron.format(layer=i) for i in layers]
        elif rule.megatron.startswith("embedding.") and first_stage:
            names.append(rule.megatron)
        elif not rule.megatron.startswith("embedding.") and last_stage:
            names.append(rule.megatron)
    return names


def hf_names(spec: ModelSpec) -> list[str]:
    """Every HF tensor name the model exports, in name-map order."""
    names: list[str] = []
    for name in megatron_names(spec):
        rule, fields = match_megatron(name, spec)
        if rule.exported:
            names += [pattern.format(**fields) for pattern in rule.hf]
    return names


def hf_shape(hf_name: str, spec: ModelSpec) -> tuple[int, ...]:
    """The shape the HF config implies for an HF tensor name (written out independently of the
    rules, so a checkpoint that disagrees with its config is caught by name)."""
    hidden, ffn, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_query_groups * d
    shapes = {
        "model.embed_tokens.weight": (spec.vocab_size, hidden),
        "lm_head.weight": (spec.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden), "self_attn.q_proj.bias": (q_rows,),
        "self_attn.k_proj.weight": (kv_rows, hidden), "self_attn.k_proj.bias": (kv_rows,),
        "self_attn.v_proj.weight": (kv_rows, hidden), "self_attn.v_proj.bias": (kv_rows,),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    key = re.sub(r"^model\.layers\.\d+\.", "", hf_name)
    if key not in shapes:
        raise ValueError(f"no known shape for HF tensor {hf_name!r}")
    return shapes[key]


def to_global_layer_name(name: str, layer_offset: int) -> str:
    """decoder.layers.{local}.* -> decoder.layers.{local + offset}.* (PP stage -> model)."""
    return _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


def to_local_layer_name(name: str, layer_offset: int) -> str:
    """Inverse of `to_global_layer_name`; the caller checks the layer belongs to its stage."""
    return _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m.group(1)) - layer_offset}.", name)


def layer_number(name: str) -> int | None:
    found = _LAYER_RE.match(name)
    return int(found.group(1)) if found else None


def canonical_name(name: str) -> str:
    """TE-spec parameter name -> local-spec name used by the rules (identity for local names)."""
    for local, te in TE_ALIASES.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


def te_name(name: str) -> str:
    """Local-spec name -> TE-spec name."""
    for local, te in TE_ALIASES.items():
        if name.endswith("." + local):
            return name[: -len(local)] + te
    return name


class HFToMegatron:
    """Collects HF tensors and emits Megatron TP shards as soon as all pieces of one are in.

    QKV needs q, k and v, linear_fc1 needs gate and up; the tied output layer reuses the embedding.
    `wanted` (global Megatron names) restricts the output to one PP stage's parameters.

        conv = HFToMegatron(spec, tp_rank, tp_size, wanted)
        for hf_name, tensor in checkpoint:
            for megatron_name, shard in conv.add(hf_name, tensor):
                ...
        conv.check_complete()
    """

    def __init__(self, spec: ModelSpec, tp_rank: int = 0, tp_size: int = 1,
                 wanted: Iterable[str] | None = None) -> None:
        self.spec, self.tp_rank, self.tp_size = spec, tp_rank, tp_size
        names = megatron_names(spec) if wanted is None else [canonical_name(n) for n in wanted]
        self._targets: dict[str, tuple[Rule, list[str]]] = {}
        self._consumers: dict[str, list[str]] = {}
        for name in names:
            rule, fields = match_megatron(name, spec)
            sources = [pattern.format(**fields) for pattern in rule.hf]
            self._targets[name] = (rule, sources)
            for src in sources:
                self._consumers.setdefault(src, []).append(name)
        self._known = set(hf_names(spec)) | set(self._consumers)
        self._pieces: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
        self.done: set[str] = set()

    def sources(self) -> list[str]:
        """The HF tensor names the wanted Megatron parameters are built from."""
        return list(self._consumers)

    def add(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Feed one HF tensor; returns the (megatron_name, shard) pairs it completed.

        Raises ValueError naming an unexpected tensor or one of the wrong shape.
        """
        if hf_name not in self._known:
            if self._ignorable(hf_name):
                return []
            raise ValueError(f"unexpected tensor {hf_name!r} for a {self.spec.arch} model "
                             f"with {self.spec.num_layers} layers")
        expected = hf_shape(hf_name, self.spec)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{expected} from the model config")
        out = []
        for name in self._consumers.get(hf_name, []):
            pieces = self._pieces[name]
            pieces[hf_name] = tensor
            rule, sources = self._targets[name]
            if len(pieces) == len(sources):
                full = rule.to_megatron([pieces[s] for s in sources], self.spec)
                out.append((name, reshape.shard_tensor(full, rule.layout, self.tp_rank, self.tp_size)))
                del self._pieces[name]
                self.done.add(name)
        return out

    def _ignorable(self, hf_name: str) -> bool:
        tied_head = self.spec.tie_word_embeddings and hf_name == "lm_head.weight"
        return tied_head or any(p.match(hf_name) for p in IGNORED_HF)

    def missing(self) -> list[str]:
        """HF tensor names still needed by incomplete Megatron parameters."""
        out = []
        for name, pieces in self._pieces.items():
            out += [s for s in self._targets[name][1] if s not in pieces]
        return sorted(set(out))

    def check_complete(self) -> None:
        missing = self.missing()
        if missing:
            raise ValueError(f"missing tensor(s) in the HF checkpoint: {missing[:8]}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def hf_to_megatron_shards(named_tensors: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec,
                          tp_rank: int = 0, tp_size: int = 1,
                          wanted: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron_name, TP shard) pairs from a stream of HF (name, tensor) pairs; global layer names.

    Raises ValueError naming any missing or unexpected HF tensor.
    """
    conv = HFToMegatron(spec, tp_rank, tp_size, wanted)
    for hf_name, tensor in named_tensors:
        yield from conv.add(hf_name, tensor)
    conv.check_complete()


def hf_to_megatron_shard(hf_name: str, tensor: torch.Tensor, spec: ModelSpec, tp_rank: int,
                         tp_size: int) -> list[tuple[str, torch.Tensor]]:
    """Shards of the Megatron parameters built from this ONE HF tensor alone.

    Only single-source parameters come out (norms, embedding, o_proj, down_proj, lm_head); fused
    QKV and gate/up need `HFToMegatron` to collect their pieces.
    """
    conv = HFToMegatron(spec, tp_rank, tp_size)
    return conv.add(hf_name, tensor)
