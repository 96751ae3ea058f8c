"""What an SGLang 0.5.23 server holds and how its `load_weights` places HF-named tensors (test double).

SGLang keeps q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` parameter; each model's
`load_weights` renames an incoming HF name with `stacked_params_mapping` and calls the fused
parameter's `weight_loader(param, tensor, shard_id)`, which copies into that shard's rows. This
module reproduces the three legacy loaders (SGLANG_ENABLE_WEIGHT_LOADER_V2 is off by default,
sglang/srt/environ.py:315) with their differences, because they decide what happens to a tensor
the server has no parameter for:

- Qwen3 (srt/models/qwen3.py:686-760): stacked names index `params_dict[name]` directly, so an
  unknown stacked name (q_proj.weight_scale_inv on a BF16 server) raises KeyError and the update
  fails; other unknown names are logged and skipped.
- Qwen2 (srt/models/qwen2.py:650-720): unknown stacked names are skipped silently (`if name not in
  params_dict: continue`); others are logged and skipped.
- Llama (srt/models/llama.py:708-780): renames `.weight_scale_inv` to `.weight_scale` and
  `.activation_scale` to `.input_scale` first, then skips unknown stacked names silently.

Parameters exist as the checkpoint the server started from defines them: a block-FP8 checkpoint
(config.json quantization_config with weight_block_size) gives each quantized linear an FP8
`weight` and a float32 `weight_scale_inv` [ceil(out/bn), ceil(in/bk)] (srt/layers/quantization/
fp8.py:612-689), and a fused layer refuses to start unless every shard's rows divide by bn
(validate_block_quant_shapes, fp8.py:570-609). A BF16 checkpoint gives no scale parameters.
`weight_loader` copies with dtype conversion (default_weight_loader / ModelWeightParameter), so FP8
values loaded into a BF16 parameter arrive unscaled: wrong weights, no error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("sglang_double.weights")

# (fused param, HF shard, shard id); Llama's mapping carries leading dots (llama.py:710), same effect.
STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


class LoadError(RuntimeError):
    """What SGLang's load_weights raises; the update endpoint answers success=False."""


@dataclass
class Param:
    """One SGLang parameter; fused ones know their shards' row ranges (shard id -> (start, rows))."""

    data: torch.Tensor
    shards: dict = field(default_factory=dict)
    block_rows: int = 1  # rows of `data` per weight row: bn for a weight_scale_inv, else 1

    def load(self, tensor: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            target = self.data
        else:
            start, rows = self.shards[shard_id]
            target = self.data[start // self.block_rows:(start + rows) // self.block_rows]
        if tuple(target.shape) != tuple(tensor.shape):
            raise LoadError(f"shape mismatch: param {tuple(target.shape)} vs loaded {tuple(tensor.shape)}")
        target.copy_(tensor.to(target.dtype))


def read_config(model_path: str | Path) -> dict:
    return json.loads((Path(model_path) / "config.json").read_text())


def block_size_of(config: dict) -> tuple[int, int] | None:
    """(bn, bk) of a block-FP8 checkpoint's quantization_config, else None."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8" and qc.get("weight_block_size"):
        return tuple(int(b) for b in qc["weight_block_size"])
    return None


def serving_dtype(config: dict, dtype_flag: str = "auto") -> torch.dtype:
    """--dtype auto: the config's torch_dtype, except float32 -> float16 (configs/model_config.py
    _get_and_verify_dtype, 2288-2320)."""
    if dtype_flag != "auto":
        return getattr(torch, dtype_flag)
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    return torch.float16 if name == "float32" else getattr(torch, name)


def _param_like(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    keep = tensor.dtype == torch.float8_e4m3fn or not tensor.is_floating_point()
    return torch.empty(tensor.shape, dtype=tensor.dtype if keep else dtype)


def build_params(checkpoint: dict[str, torch.Tensor], config: dict, dtype: torch.dtype = torch.float16
                 ) -> dict[str, Param]:
    """SGLang's named_parameters() for this checkpoint (fused names; FP8 weights and float32 scales
    as serialized, everything else in the serving `dtype`).

    Raises LoadError when a fused block-FP8 layer has a shard whose rows do not divide by bn,
    as SGLang refuses at startup."""
    block = block_size_of(config)
    layout: dict[str, dict] = {}  # fused name -> {shard_id: (rows, cols, dtype)}
    params: dict[str, Param] = {}
    for name, tensor in checkpoint.items():
        fused = _fused_target(name.replace("_scale_inv", ""))
        if fused is None:
            if not (config.get("tie_word_embeddings") and name == "lm_head.weight"):
                scale = name.endswith("_scale_inv")
                params[name] = Param(_param_like(tensor, torch.float32 if scale else dtype))
            continue
        fused_name, shard_id = fused
        if name.endswith("_scale_inv"):
            continue  # sized from the weight shards below
        kept = tensor.dtype if tensor.dtype == torch.float8_e4m3fn else dtype
        layout.setdefault(fused_name, {})[shard_id] = (tensor.shape[0], tensor.shape[1:], kept)
    for fused_name, shards in layout.items():
        params.update(_fused_params(fused_name, shards, block, checkpoint))
    if config.get("tie_word_embeddings"):
        params.pop("lm_head.weight", None)  # tied: one parameter, named embed_tokens (named_parameters dedups)
    return params


def _fused_target(name: str):
    for fused, shard, shard_id in STACKED:
        if f".{shard}." in name:
            return name.replace(shard, fused), shard_id
    return None


def _fused_params(fused_name: str, shards: dict, block, checkpoint) -> dict[str, Param]:
    order = [s for _, _, s in STACKED if s in shards]
    starts, start = {}, 0
    for s in order:
        starts[s] = (start, shards[s][0])
        start += shards[s][0]
    rows, rest, dtype = start, shards[order[0]][1], shards[order[0]][2]
    out = {fused_name: Param(torch.empty((rows, *rest), dtype=dtype), starts)}
    scale_name = fused_name + "_scale_inv"
    has_scale = any(n.endswith("_scale_inv") and (_fused_target(n.replace("_scale_inv", "")) or ("",))[0]
                    == fused_name for n in checkpoint)
    if block is not None and has_scale:
        bn, bk = block
        for s, (_, r) in starts.items():
            if r % bn:
                raise LoadError(f"Weight output_partition_size = {r} is not divisible by weight "
                                f"quantization block_n = {bn}.")
        cols = -(-rest[0] // bk)
        out[scale_name] = Param(torch.full((rows // bn, cols), torch.finfo(torch.float32).min), starts, bn)
    return out


def load_weights(arch: str, params: dict[str, Param], weights) -> list[str]:
    """SGLang's <arch>.load_weights over (HF name, tensor) pairs; returns the names it skipped.

    Raises LoadError for what raises in SGLang (Qwen3's KeyError on an unknown stacked name, a
    shape mismatch in a weight_loader)."""
    skipped = []
    for name, tensor in weights:
        if arch == "llama":
            name = name.replace(".activation_scale", ".input_scale").replace(".weight_scale_inv", ".weight_scale")
        if "rotary_emb.inv_freq" in name:
            continue
        for fused, shard, shard_id in STACKED:
            if shard not in name:
                continue
            name = name.replace(shard, fused)
            if name not in params:
                if arch == "qwen3":
                    raise LoadError(f"KeyError: {name!r}")  # params_dict[name], qwen3.py:744
                skipped.append(name)  # qwen2.py:701 / llama.py:759: `continue`
                break
            params[name].load(tensor, shard_id)
            break
        else:
            if name in params:
                params[name].load(tensor)
            elif not name.endswith(".bias"):
                log.warning("Parameter %s not found in params_dict", name)
                skipped.append(name)
    return skipped


def to_hf(params: dict[str, Param]) -> list[tuple[str, torch.Tensor]]:
    """The held parameters split back into HF names (what the embedded engine generates from)."""
    out = []
    for name, p in params.items():
        if not p.shards:
            out.append((name, p.data))
            continue
        for fused, shard, shard_id in STACKED:
            if fused in name and shard_id in p.shards:
                start, rows = p.shards[shard_id]
                out.append((name.replace(fused, shard), p.data[start // p.block_rows:(start + rows) // p.block_rows]))
    return out
