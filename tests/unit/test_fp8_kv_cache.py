"""The embedded engine's emulated FP8 KV cache: E4M3 rounding at a scale (by hand), and the engine
serving through it with the scales a sync delivers."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.fp8_kv_cache import fake_e4m3
from megatron_rl.rollout.sglang_payload import kv_scale_tensors
from megatron_rl.rollout.torch_engine import TorchRolloutEngine


def test_e4m3_rounding_at_a_scale():
    # 0.3 = 1.2 x 2^-2: E4M3's 3 mantissa bits give 1.25 x 2^-2 = 0.3125; at scale 0.01, 30 = 1.875 x 16 is exact.
    assert fake_e4m3(torch.tensor([0.3]), 1.0).item() == 0.3125
    assert fake_e4m3(torch.tensor([0.3]), 0.01).item() == pytest.approx(0.3, rel=1e-6)
    # 1e-4 is below E4M3's smallest subnormal (2^-9) at unit scale: flushed; at 1e-5 it is 10, exact.
    assert fake_e4m3(torch.tensor([1e-4]), 1.0).item() == 0.0
    assert fake_e4m3(torch.tensor([1e-4]), 1e-5).item() == pytest.approx(1e-4, rel=1e-6)


def test_engine_serves_through_the_fp8_cache_with_synced_scales(qwen2_dir):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [3, 4]]
    plain = TorchRolloutEngine(qwen2_dir).generate(prompts, greedy)
    engine = TorchRolloutEngine(qwen2_dir, kv_cache_dtype="fp8_e4m3")
    unit = engine.generate(prompts, greedy)
    layers = engine.config.num_hidden_layers
    scales = kv_scale_tensors([(0.01, 0.02)] * layers)
    engine.update_weights(scales, version=1)
    engine.finish_update(1)
    assert [x for kv in engine.kv_scales for x in kv] == pytest.approx([0.01, 0.02] * layers)  # float32 sent
    assert set(engine.checksum([n for n, _ in scales])) == {n for n, _ in scales}  # the sync check sees them
    calibrated = engine.generate(prompts, greedy)
    # First tokens only: greedy paths may part once a token differs.
    lp = lambda samples: torch.tensor([s.rollout_logprobs[0] for s in samples])  # noqa: E731
    assert not torch.equal(lp(unit), lp(plain)) and not torch.equal(lp(calibrated), lp(unit))
    assert (lp(unit) - lp(plain)).abs().max() < 0.1
