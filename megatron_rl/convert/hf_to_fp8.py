"""HF (BF16/FP32) checkpoint -> HF FP8 blockwise checkpoint in the layout SGLang loads, streamed.

Every tensor the precision contract quantizes (fp8.rollout_quant.RolloutQuantSpec: 2-D `.weight`
outside the high-precision substrings embed_tokens / lm_head / norm) becomes
`X.weight` float8_e4m3fn [out, in] plus `X.weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)],
quantized by the same quantizer as the weight sync (fp8.w8a8.quantize_weight_blockwise), so an
engine loading this folder holds exactly what a sync would send. All other tensors are copied
byte for byte. config.json gains the `quantization_config` SGLang's Fp8Config reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rl.convert.output import Summary, atomic_output_dir, copy_side_files, progress_bar
from megatron_rl.convert.safetensors_io import HFSafetensors, ShardedSafetensorsWriter, TensorEntry
from megatron_rl.models.hf_config import ModelSpec
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def fp8_entries(entry: TensorEntry, quant: RolloutQuantSpec) -> list[TensorEntry]:
    """The output tensors one input tensor becomes (itself, or FP8 weight + its scale)."""
    if not quant.quantizes(entry.name, torch.empty(entry.shape, device="meta")):
        return [entry]
    (rows, cols), (bo, bi) = entry.shape, quant.weight_block_size
    scale_shape = (-(-rows // bo), -(-cols // bi))
    return [TensorEntry(entry.name, entry.shape, torch.float8_e4m3fn),
            TensorEntry(entry.name + "_scale_inv", scale_shape, torch.float32)]


def quantization_config(quant: RolloutQuantSpec, not_converted: list[str]) -> dict:
    """config.json `quantization_config` (SGLang/vLLM Fp8Config; DeepSeek-V3 / Qwen3-FP8 spelling)."""
    config: dict = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(quant.weight_block_size)}
    if quant.scale_format == "ue8m0":
        config["scale_fmt"] = "ue8m0"  # power-of-two scales (DeepGEMM); values stay float32
    if not_converted:
        config["modules_to_not_convert"] = not_converted
    return config


def _not_converted(entries: list[TensorEntry], quant: RolloutQuantSpec) -> list[str]:
    """Linear modules left in high precision (embeddings and norms are not linear modules)."""
    names = []
    for entry in entries:
        meta = torch.empty(entry.shape, device="meta")
        is_linear = entry.name.endswith(".weight") and len(entry.shape) == 2 and "embed_tokens" not in entry.name
        if is_linear and not quant.quantizes(entry.name, meta):
            names.append(entry.name.removesuffix(".weight"))
    return names


def _check_block_size(block_size: tuple[int, int]) -> tuple[int, int]:
    if len(block_size) != 2 or min(block_size) < 1:
        raise ValueError(f"block_size={block_size} must be two positive ints (rows, cols)")
    return int(block_size[0]), int(block_size[1])


def convert_hf_to_fp8(hf_dir: str | Path, out_dir: str | Path, *,
                      block_size: tuple[int, int] = (128, 128), scale_format: str = "fp32",
                      high_precision: tuple[str, ...] | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                      progress: bool = True) -> Summary:
    """Write the FP8 checkpoint to `out_dir` (atomic); returns the summary.

    Raises ValueError for an unsupported architecture, an already quantized input, a bad block
    size or scale format, or an existing non-empty `out_dir` without `overwrite`.
    """
    from megatron_rl.fp8.w8a8 import SCALE_FORMATS, quantize_weight_blockwise

    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format={scale_format!r} is not one of {SCALE_FORMATS}")
    config = json.loads((_config_path(hf_dir)).read_text())
    if "quantization_config" in config:
        raise ValueError(f"{hf_dir} is already quantized: {config['quantization_config']}")
    spec = ModelSpec.from_hf_config(config)
    hp = RolloutQuantSpec.high_precision if high_precision is None else tuple(high_precision)
    quant = RolloutQuantSpec("fp8_blockwise", _check_block_size(block_size), scale_format, hp)
    ckpt = HFSafetensors(hf_dir)
    inputs = [ckpt.entry(name) for name in ckpt.names()]
    entries = [out for entry in inputs for out in fp8_entries(entry, quant)]
    summary = Summary("convert_hf_to_fp8", str(Path(out_dir).absolute()))
    with atomic_output_dir(out_dir, overwrite) as tmp, \
            progress_bar(ckpt.total_bytes, "hf->fp8", progress) as bar, \
            ShardedSafetensorsWriter(tmp, entries, max_shard_bytes) as writer:
        for entry in inputs:
            tensor = ckpt.get(entry.name)
            if len(fp8_entries(entry, quant)) == 2:
                weight, scale_inv = quantize_weight_blockwise(tensor, quant.weight_block_size, scale_format)
                writer.write(entry.name, weight)
                writer.write(entry.name + "_scale_inv", scale_inv)
                summary.details["quantized"] = int(summary.details.get("quantized", 0)) + 1
            else:
                writer.write(entry.name, tensor)
            del tensor  # drops the memory map of this tensor's pages
            bar.update(entry.nbytes)
            summary.bytes_read += entry.nbytes
        summary.bytes_written = writer.close()
        config["quantization_config"] = quantization_config(quant, _not_converted(inputs, quant))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copied = copy_side_files(hf_dir, tmp, skip=("config.json",))
    summary.num_tensors = len(entries)
    summary.details.update({"architecture": spec.hf_architecture, "block size": list(quant.weight_block_size),
                            "scale format": scale_format, "high precision": ", ".join(hp),
                            "side files": ", ".join(copied) or "none"})
    return summary.finish()


def _config_path(hf_dir: str | Path) -> Path:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise ValueError(f"HF checkpoint folder not found: {hf_dir}")
    if not path.is_file():
        raise ValueError(f"HF config not found: {path}")
    return path
