"""Megatron-Core torch_dist checkpoint -> HF safetensors folder, one layer at a time, without Megatron.

Reads this package's own folders and the trainer's (`checkpoints/step_N/model`, whatever TP/PP
they were saved with: torch_dist stores global tensors). Only model parameters are read; the
optimizer state and any other keys are counted and ignored.
"""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path
from typing import Iterator

import torch

from megatron_rl.convert import mcore_layout as layout
from megatron_rl.convert.output import Summary, atomic_output_dir, copy_side_files, progress_bar
from megatron_rl.convert.safetensors_io import ShardedSafetensorsWriter, TensorEntry
from megatron_rl.convert.torch_dist_io import TorchDistReader, find_torch_dist_dir, read_content_metadata
from megatron_rl.models import name_map
from megatron_rl.models.hf_config import ModelSpec

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
CONFIG_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' historical default shard size ("5GB")


def find_hf_config(dist_dir: Path, hf_config_dir: str | Path | None) -> tuple[dict, Path | None]:
    """(config.json as a dict, folder to copy tokenizer files from, or None).

    Order: --hf-config-dir; the `hf/` folder this package writes next to the checkpoint data (or
    next to a trainer step's `model/`); the HF config recorded in common.pt's content_metadata.
    """
    if hf_config_dir is not None:
        config = Path(hf_config_dir) / "config.json"
        if not config.is_file():
            raise ValueError(f"--hf-config-dir {hf_config_dir} has no config.json")
        return json.loads(config.read_text()), Path(hf_config_dir)
    for folder in (dist_dir / "hf", dist_dir.parent / "hf"):
        if (folder / "config.json").is_file():
            return json.loads((folder / "config.json").read_text()), folder
    recorded = read_content_metadata(dist_dir).get("hf_config")
    if isinstance(recorded, dict):
        return recorded, None
    raise ValueError(f"no HF config found for {dist_dir}: pass --hf-config-dir (the HF model folder "
                     "the run started from, holding config.json and the tokenizer)")


MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
# Parameter spellings; buffers (FP8 delayed-scaling `fp8_state.*`, ...) are not weights to export.
PARAMETER_SUFFIXES = (".weight", ".bias", ".layer_norm_weight", ".layer_norm_bias")


def _check_no_unknown_parameters(keys: dict, used: set[str], dist_dir: Path) -> None:
    """Model parameters the config does not describe mean the wrong config (e.g. a bias dropped)."""
    unknown = sorted(k for k in keys if k.startswith(MODEL_KEY_PREFIXES)
                     and k.endswith(PARAMETER_SUFFIXES) and k not in used)
    if unknown:
        raise ValueError(f"{dist_dir} holds parameters the HF config does not describe: {unknown[:5]} "
                         "(wrong --hf-config-dir?)")


def _hf_entries(tensors: list[layout.StoredTensor], spec: ModelSpec,
                dtypes: dict[str, torch.dtype]) -> list[TensorEntry]:
    """HF names and shapes, planned on meta tensors through the same rules as the real data."""
    entries = []
    for tensor in tensors:
        meta = torch.empty(tensor.full_shape, device="meta")
        for hf_name, piece in name_map.megatron_to_hf(tensor.megatron_name, meta, spec):
            entries.append(TensorEntry(hf_name, tuple(piece.shape), dtypes[tensor.megatron_name]))
    return entries


def _read_full(reader: TorchDistReader, group: list[layout.StoredTensor],
               located: dict[str, tuple[str, layout.Box]]) -> Iterator[tuple[layout.StoredTensor, torch.Tensor]]:
    """(tensor, full Megatron tensor) for a group of tensors read with one DCP call."""
    loaded = reader.read({located[t.megatron_name][0]: located[t.megatron_name][1] for t in group})
    for tensor in group:
        yield tensor, loaded.pop(located[tensor.megatron_name][0]).reshape(tensor.full_shape)


def _hf_config_out(config: dict, spec: ModelSpec, dtypes: set[torch.dtype]) -> dict:
    out = dict(config)
    out["architectures"] = [spec.hf_architecture]
    if len(dtypes) == 1 and next(iter(dtypes)) in CONFIG_DTYPE_NAMES:
        name = CONFIG_DTYPE_NAMES[next(iter(dtypes))]
        keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]
        out.update({k: name for k in keys})
    out.pop("quantization_config", None)  # the weights written here are never quantized
    return out


def convert_megatron_to_hf(ckpt_dir: str | Path, out_dir: str | Path, *,
                           hf_config_dir: str | Path | None = None, dtype: str | None = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                           progress: bool = True) -> Summary:
    """Write HF safetensors shards + index + config (+ tokenizer files) to `out_dir` (atomic).

    Args:
        ckpt_dir: a torch_dist folder, a trainer step folder or a checkpoints root (its latest).
        hf_config_dir: HF folder with config.json and tokenizer; optional when the checkpoint
            carries them (see `find_hf_config`).
        dtype: "bf16" | "fp32" | "fp16" | None (keep the stored dtype).
    Raises ValueError naming the problem (no checkpoint, no config, unsupported architecture, a
    parameter missing or shaped unlike the config).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    dist_dir = find_torch_dist_dir(ckpt_dir)
    reader = TorchDistReader(dist_dir)
    config, side_dir = find_hf_config(dist_dir, hf_config_dir)
    spec = ModelSpec.from_hf_config(config)
    tensors = layout.stored_tensors(spec)
    keys = reader.shapes()
    located = {t.megatron_name: layout.locate(t, keys) for t in tensors}
    _check_no_unknown_parameters(keys, {key for key, _ in located.values()}, dist_dir)
    dtypes = {t.megatron_name: DTYPES[dtype] if dtype else reader.dtype(located[t.megatron_name][0])
              for t in tensors}
    entries = _hf_entries(tensors, spec, dtypes)
    summary = Summary("convert_megatron_to_hf", str(Path(out_dir).absolute()))
    total = sum(e.nbytes for e in entries)
    with atomic_output_dir(out_dir, overwrite) as tmp, progress_bar(total, "megatron->hf", progress) as bar, \
            ShardedSafetensorsWriter(tmp, entries, max_shard_bytes) as writer:
        for _, group in groupby(tensors, key=lambda t: t.layer):  # one read per layer
            for tensor, full in _read_full(reader, list(group), located):
                summary.bytes_read += full.numel() * full.element_size()
                for hf_name, piece in name_map.megatron_to_hf(tensor.megatron_name, full, spec):
                    writer.write(hf_name, piece.to(dtypes[tensor.megatron_name]).contiguous())
                    bar.update(piece.numel() * dtypes[tensor.megatron_name].itemsize)
                    summary.num_tensors += 1
        summary.bytes_written = writer.close()
        out_config = _hf_config_out(config, spec, set(dtypes.values()))
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
        copied = copy_side_files(side_dir, tmp, skip=("config.json",)) if side_dir else []
    used = {key for key, _ in located.values()}
    summary.details.update({"checkpoint": str(dist_dir), "architecture": spec.hf_architecture,
                            "ignored": f"{len(keys) - len(used)} tensor key(s) (optimizer, FP8 state, ...), "
                                       f"{reader.num_objects} object(s) (extra state, ...)",
                            "side files": ", ".join(copied) or "none (no tokenizer found)",
                            "files": len(set(writer.weight_map.values()))})
    return summary.finish()
