"""An HF safetensors folder from full HF-named tensors in memory (the trainer's export during a run)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rl.convert.megatron_to_hf import DEFAULT_MAX_SHARD_BYTES, _hf_config_out
from megatron_rl.convert.output import atomic_output_dir, copy_side_files
from megatron_rl.convert.safetensors_io import ShardedSafetensorsWriter, TensorEntry
from megatron_rl.models.hf_config import ModelSpec


def write_hf_folder(out_dir: str | Path, tensors: dict[str, torch.Tensor], side_dir: str | Path,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `tensors` (HF names -> full CPU tensors) as safetensors shards + index, with config.json
    (architecture and dtype of what is written) and the tokenizer files of `side_dir`; atomic: a
    kill leaves no folder named `out_dir`, and an existing one is replaced whole."""
    config = json.loads((Path(side_dir) / "config.json").read_text())
    spec = ModelSpec.from_hf_config(config)
    entries = [TensorEntry(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    with atomic_output_dir(out_dir, overwrite=True) as tmp:
        with ShardedSafetensorsWriter(tmp, entries, max_shard_bytes) as writer:
            for name, tensor in tensors.items():
                writer.write(name, tensor)
            writer.close()
        out_config = _hf_config_out(config, spec, {t.dtype for t in tensors.values()})
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
        copy_side_files(side_dir, tmp, skip=("config.json",))
    return Path(out_dir)
