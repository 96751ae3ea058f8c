"""RoPE inverse frequencies from the HF config and per-token rotary angles for Megatron attention.

Megatron's GPTModel derives RoPE from positions 0..S-1 and hard-codes the llama3 scaling constants
(ecosystem.md). The actor instead passes angles computed here from each token's position, which
makes packed rows (positions restart per sequence) and any rope_type below exact.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.models.hf_config import ModelSpec


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, computed the way transformers computes them."""
    dim = spec.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (spec.rope_theta ** exponent)
    if spec.rope_type == "linear":
        return inv_freq / spec.rope_factor
    if spec.rope_type == "llama3":
        return _llama3_scaling(inv_freq, spec)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (Meta's reference, as in transformers)."""
    factor, old_len = spec.rope_factor, spec.rope_original_max_position_embeddings
    low, high = spec.rope_low_freq_factor, spec.rope_high_freq_factor
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_angles(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Rotary angles in Megatron's layout.

    Args:
        inv_freq: [D/2] float32 from `rope_inv_freq`.
        position_ids: [B, S] int64.
    Returns:
        [S, B, 1, D] float32 (non-interleaved halves, like HF's rotate_half). On the CPU, when
        every row has the same positions the batch dim is 1 (broadcasts like Megatron's own).
    """
    # The dedup test is free on the CPU; on a GPU it would be a host sync per micro-batch, so
    # there the rows stay (same values, a larger broadcast).
    on_cpu = position_ids.device.type == "cpu"
    if on_cpu and position_ids.shape[0] > 1 and bool((position_ids == position_ids[:1]).all()):
        position_ids = position_ids[:1]
    # Same product as HF (float32 position times float32 inv_freq): identical angles.
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.transpose(0, 1)[:, :, None, :].contiguous()
