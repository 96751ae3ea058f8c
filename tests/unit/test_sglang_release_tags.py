"""Colocated release / resume per tag against a server double whose CUDA graphs live in the memory
saver (SGLANG_MEMORY_SAVER_CUDA_GRAPH=1): the protocol's tags bring every released region back."""

from __future__ import annotations

import pytest
import torch

from sglang_testing import DOUBLES_TIMEOUT_S, make_engine, needs_sglang_source

from megatron_rl.loop.colocated import RELEASE_TAGS, RESUME_AFTER_SYNC
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_engine import RolloutUnavailableError
from megatron_rl.sync.sglang_transport import SGLangTensorTransport

pytestmark = [needs_sglang_source, pytest.mark.timeout(DOUBLES_TIMEOUT_S)]


def _update(engine, model_dir, kv_scales: bool = False):
    """A full update of the checkpoint's weights (with unit k_scale / v_scale per layer: kv_scales)."""
    import json

    from safetensors.torch import load_file

    named = sorted(load_file(str(model_dir / "model.safetensors")).items())
    if kv_scales:
        layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        named += [(f"model.layers.{i}.self_attn.{leaf}", torch.tensor(1.0)) for i in range(layers)
                  for leaf in ("k_scale", "v_scale")]
    transport = SGLangTensorTransport(engine)
    version = engine.weight_version + 1
    transport.begin(version)
    transport.send(named, version)
    transport.finish(version)


def test_protocol_tags_bring_the_cuda_graphs_back(qwen2_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "1")  # the servers inherit it (launch_env)
    engine = make_engine(qwen2_dir, num_servers=1, max_retries=0)
    sampling = SamplingParams(max_new_tokens=2, n=1, ignore_eos=True)
    try:
        engine.generate([[3, 4]], sampling)
        engine.release_memory(RELEASE_TAGS)
        engine.resume_memory(("weights",))
        _update(engine, qwen2_dir)
        engine.resume_memory(("kv_cache",))  # the resume before the fix: graphs stay unmapped
        with pytest.raises(RolloutUnavailableError):
            engine.generate([[3, 4]], sampling)
        engine.resume_memory(tuple(t for t in RESUME_AFTER_SYNC if t != "kv_cache"))
        assert len(engine.generate([[3, 4]], sampling)[0].response_ids) == 2
        assert set(RELEASE_TAGS) == {"weights"} | set(RESUME_AFTER_SYNC)  # every released tag comes back
    finally:
        engine.shutdown()


@pytest.mark.parametrize("releases", [[("weights",)], [None], [("weights",), ("kv_cache",)]])
def test_unit_kv_scales_must_come_again_once_the_weights_were_released(qwen2_dir, releases):
    """SGLang keeps k_scale / v_scale in its weight memory: releasing the KV cache alone keeps them
    (an update without scales is fine with unit scales), releasing the weights (by tag, or every
    region when no tag is named) discards them, so the next update must bring them, whatever was
    released after them."""
    engine = make_engine(qwen2_dir, num_servers=1, max_retries=0, kv_cache_dtype="fp8_e4m3", kv_scales="unit")
    try:
        engine.release_memory(("kv_cache",))
        engine.resume_memory(("kv_cache",))
        _update(engine, qwen2_dir)  # no k_scale / v_scale sent: the weights held their scales
        assert engine.weight_version == 1
        for tags in releases:
            engine.release_memory(tags)
        for tags in releases:
            engine.resume_memory(tags)
        with pytest.raises(ValueError) as refused:
            _update(engine, qwen2_dir)
        assert str(refused.value) == (
            "version 2: an FP8 KV cache needs k_scale/v_scale tensors with this update (rollout.sglang.kv_scales="
            "'unit', weights released since the last one); stale KV scales silently corrupt attention")
        _update(engine, qwen2_dir, kv_scales=True)  # the refused update again, with the scales
        _update(engine, qwen2_dir)  # nothing released since: the scales held are the ones sent
        assert engine.weight_version == 3
    finally:
        engine.shutdown()
