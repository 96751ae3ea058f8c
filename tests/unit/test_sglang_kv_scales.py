"""FP8 KV-cache scales against a server double with --kv-cache-dtype fp8_e4m3: a weights release
discards SGLang's k_scale / v_scale with the weights, so every update after one carries them."""

from __future__ import annotations

import pytest
import torch

from sglang_testing import DOUBLES_TIMEOUT_S, make_engine, needs_sglang_source

from megatron_rl.config import load_config
from megatron_rl.loop.build import kv_scales_source
from megatron_rl.rollout.sglang_payload import kv_scale_tensors
from megatron_rl.sync.sglang_transport import SGLangTensorTransport

pytestmark = [pytest.mark.timeout(DOUBLES_TIMEOUT_S)]


def _update(engine, model_dir, extra=()):
    from safetensors.torch import load_file

    named = sorted(load_file(str(model_dir / "model.safetensors")).items()) + list(extra)
    transport = SGLangTensorTransport(engine)
    version = engine.weight_version + 1
    transport.begin(version)
    transport.send(named, version)
    transport.finish(version)


@needs_sglang_source
def test_scales_sent_after_a_release_are_the_ones_attention_uses(qwen2_dir):
    engine = make_engine(qwen2_dir, num_servers=1, kv_cache_dtype="fp8_e4m3")
    layers = 2
    try:
        scales = engine.servers[0].client.get("/_double/kv_scales")
        assert scales == [[1.0, 1.0]] * layers  # SGLang's default without scales in the checkpoint
        engine.release_memory()
        engine.resume_memory(("weights",))
        _update(engine, qwen2_dir, kv_scale_tensors([(0.5, 0.25), (1.0, 1.0)]))
        assert engine.servers[0].client.get("/_double/kv_scales") == [[0.5, 0.25], [1.0, 1.0]]
        engine.release_memory()
        engine.resume_memory(("weights",))
        with pytest.raises(ValueError, match="k_scale/v_scale.*weights released"):
            _update(engine, qwen2_dir)  # unit scales not resent: attention would use the discarded memory
        held = engine.servers[0].client.get("/_double/kv_scales")
        assert held[0][0] != 1.0  # what a server left with released scales holds
    finally:
        engine.shutdown()


def test_unit_scales_go_with_every_sync_of_an_fp8_kv_cache():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.kv_cache_dtype=fp8_e4m3"])
    named = kv_scales_source(cfg, 2)()
    assert [n for n, _ in named] == ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale",
                                     "model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"]
    assert all(float(t) == 1.0 and t.dim() == 0 for _, t in named)
    assert kv_scales_source(load_config(None, ["rollout.engine=sglang"]), 2) is None  # BF16 KV cache


def test_calibrated_scales_are_what_the_sync_sends(single_parallel):
    from megatron_rl.loop.build import kv_calibration_for

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.kv_cache_dtype=fp8_e4m3"])
    assert cfg.rollout.sglang.kv_scales == "calibrated"  # the default with an FP8 KV cache
    calib = kv_calibration_for(cfg, 2, single_parallel)
    calib.amax[:] = torch.tensor([[4.48, 8.96], [44.8, 0.448]], dtype=torch.float64)  # as a recording leaves it
    sent = dict(kv_scales_source(cfg, 2, calib)())
    assert float(sent["model.layers.0.self_attn.v_scale"]) == pytest.approx(0.02)
    assert float(sent["model.layers.1.self_attn.k_scale"]) == pytest.approx(0.1)
