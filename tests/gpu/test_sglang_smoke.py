"""Real SGLang on a GPU: launch, generate with log-probs, weight updates by each transport, memory release.

Skipped without CUDA or without a full sglang install (the CPU tests use the SGLang double, tests/doubles).
"""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang"),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("tiny_qwen3")
    make_tiny_hf_model("qwen3", out, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024)
    return out


@pytest.fixture(scope="module")
def engine(model_dir):
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    os.environ.setdefault("MEGATRON_RL_SGLANG_API_KEY", "smoke-test-key")
    cfg = SGLangConfig(mode="colocated", base_port=_port(), mem_fraction_static=0.3,
                       extra_args=["--skip-server-warmup", "--disable-cuda-graph"])
    eng = SGLangEngine(cfg, model_dir, log_dir=model_dir)
    yield eng
    eng.shutdown()


def _weights(model_dir, scale: float):
    from safetensors.torch import load_file

    w = load_file(str(model_dir / "model.safetensors"))
    return [(n, (t.float() * scale).to(t.dtype).cuda()) for n, t in sorted(w.items())]


def test_generate_logprobs_match_hf(engine, model_dir):
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout.base import SamplingParams

    samples = engine.generate([[1, 2, 3, 4], [7, 8]], SamplingParams(max_new_tokens=8, n=2, seed=0, ignore_eos=True))
    assert len(samples) == 4 and all(len(s.response_ids) == 8 for s in samples)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    s = samples[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0], -1)
    ref = [logp[len(s.prompt_ids) - 1 + i, t].item() for i, t in enumerate(s.response_ids)]
    assert s.rollout_logprobs == pytest.approx(ref, abs=0.1)  # bf16 serving vs fp32 reference


def test_tensor_transport_update_and_memory_release(engine, model_dir):
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.sync.buckets import iter_buckets
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    before = engine.generate([[5, 6, 7]], greedy)[0]
    engine.release_memory()
    engine.resume_memory()
    transport = SGLangTensorTransport(engine, check=True)
    version = engine.weight_version + 1
    transport.begin(version)
    named = _weights(model_dir, 0.5)
    for bucket in iter_buckets(named, 1 << 20):
        transport.send(bucket, version)
    transport.finish(version)
    assert transport.checksums([n for n, _ in named])
    after = engine.generate([[5, 6, 7]], greedy)[0]
    assert engine.weight_version == version
    assert after.rollout_logprobs != before.rollout_logprobs


def test_disk_transport_update(engine, model_dir, tmp_path):
    from megatron_rl.sync.buckets import iter_buckets
    from megatron_rl.sync.disk_transport import DiskTransport

    transport = DiskTransport(engine, tmp_path, template_dir=model_dir)
    version = engine.weight_version + 1
    transport.begin(version)
    for bucket in iter_buckets(_weights(model_dir, 1.0), 1 << 20):
        transport.send(bucket, version)
    transport.finish(version)
    assert engine.weight_version == version


def test_fp8_kv_cache_graphs_and_the_split_resume(model_dir, tmp_path, monkeypatch):
    """The colocated protocol on a block-FP8 server with an FP8 KV cache and CUDA graphs captured in
    the memory saver: release every tag, resume the weights, an FP8 update with unit KV scales in
    the session, resume KV cache + graphs; greedy output is back to what it was."""
    import json

    from megatron_rl.convert.hf_to_fp8 import convert_hf_to_fp8
    from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout
    from megatron_rl.loop.colocated import RELEASE_TAGS, RESUME_AFTER_SYNC
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.rollout.sglang_payload import kv_scale_tensors
    from megatron_rl.sync.buckets import iter_buckets
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "1")  # the server inherits it
    fp8_dir = tmp_path / "fp8"
    convert_hf_to_fp8(model_dir, fp8_dir, block_size=(128, 128))
    cfg = SGLangConfig(mode="colocated", base_port=_port(), mem_fraction_static=0.3, kv_cache_dtype="fp8_e4m3",
                       extra_args=["--skip-server-warmup", "--cuda-graph-max-bs", "4"])
    engine = SGLangEngine(cfg, fp8_dir, log_dir=tmp_path)
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        before = engine.generate([[5, 6, 7]], greedy)[0]
        engine.release_memory(RELEASE_TAGS)
        engine.resume_memory(("weights",))
        layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        named = list(quantize_for_rollout(_weights(model_dir, 1.0), RolloutQuantSpec("fp8_blockwise", (128, 128))))
        named += kv_scale_tensors([(1.0, 1.0)] * layers, "cuda")
        transport = SGLangTensorTransport(engine)
        version = engine.weight_version + 1
        transport.begin(version)
        for bucket in iter_buckets(named, 1 << 20):
            transport.send(bucket, version)
        transport.finish(version)
        engine.resume_memory(RESUME_AFTER_SYNC)
        after = engine.generate([[5, 6, 7]], greedy)[0]
        assert after.response_ids == before.response_ids
    finally:
        engine.shutdown()
