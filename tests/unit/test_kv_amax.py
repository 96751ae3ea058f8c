"""Calibrated FP8 KV-cache scales: the per-layer K/V amax the actor records in a forward equals the
amax of the keys and values HF's model caches (after RoPE) on the same tokens."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.kv_amax import E4M3_MAX, KvCalibration


def hf_kv_amax(model_dir, tokens: torch.Tensor) -> list[tuple[float, float]]:
    """Independent reference: transformers' KV cache holds post-RoPE keys and the values."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(tokens, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    layers = cache.layers if hasattr(cache, "layers") else None
    pairs = [(layer.keys, layer.values) for layer in layers] if layers is not None else list(cache)
    return [(float(k.abs().max()), float(v.abs().max())) for k, v in pairs]


def test_recorded_amax_is_the_cached_keys_and_values(qwen2_dir, single_parallel):
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, actor.spec.vocab_size, (2, 12), generator=gen)
    batch = {"tokens": tokens, "loss_mask": torch.ones(2, 12)}  # full rows: no padding token is seen
    calib = KvCalibration(actor.spec.num_layers, single_parallel)
    assert calib.scales() == [(1.0, 1.0)] * actor.spec.num_layers  # unit until the first recording
    with calib.recording(actor.model):
        actor.compute_logprobs(batch, micro_batch_size=1, with_entropy=False)
    expected = hf_kv_amax(qwen2_dir, tokens)
    got = [(k * E4M3_MAX, v * E4M3_MAX) for k, v in calib.scales()]
    assert [x for kv in got for x in kv] == pytest.approx([x for kv in expected for x in kv], rel=1e-4)
    assert len({k for k, _ in got}) > 1  # per layer, not one number
