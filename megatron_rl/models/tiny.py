"""Tiny random-weight HF models (Llama / Qwen2 / Qwen3) built from a config, for tests and CPU runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Small enough for a 2-core CI box, large enough to exercise GQA (4 heads, 2 KV groups), TP=2
# (every sharded dim even) and PP=2 (2 layers per stage with num_layers=4).
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen2": dict(rope_theta=1000000.0),
    "qwen3": dict(rope_theta=1000000.0, head_dim=32),
}


def tiny_hf_config(arch: str, **overrides: Any):
    """A transformers config for a tiny model of `arch` ("llama" | "qwen2" | "qwen3")."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"arch={arch!r} is not supported; supported: {sorted(classes)}")
    kwargs = {**TINY_DEFAULTS, **ARCH_DEFAULTS[arch], **overrides}
    return classes[arch](**kwargs)


def tiny_model_kwargs(m, tokenizer) -> dict:
    """HF config fields of the tiny model of a `model` config section (this module's defaults fill the rest)."""
    return dict(vocab_size=len(tokenizer), hidden_size=m.tiny_hidden_size,
                num_hidden_layers=m.tiny_num_layers, num_attention_heads=m.tiny_num_heads,
                num_key_value_heads=m.tiny_num_kv_heads, intermediate_size=m.tiny_ffn_hidden_size,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def make_tiny_hf_model(arch: str, out_dir: str | Path | None = None, *, seed: int = 0,
                       dtype: torch.dtype = torch.float32, **overrides: Any):
    """Build a random tiny HF causal LM; save it (config.json + safetensors) if out_dir is given.

    The weights are re-drawn from N(0, 0.1) (norms around 1) so that every tensor, including the
    RMSNorm weights HF initializes to ones, carries a layout-revealing random pattern.
    Returns the model (eval mode).
    """
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, **overrides)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            value = 1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise
            param.copy_(value.to(dtype))
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
    return model
