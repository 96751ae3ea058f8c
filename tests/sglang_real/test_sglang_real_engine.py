"""The project's SGLangEngine and weight transports against the real SGLang 0.5.23 server on CPU.

Expected tokens and log-probs come from an independent greedy loop over the Hugging Face model with
the weights that were sent (float32 on both sides: the server runs --dtype float32), so a transport
that drops, reorders or misnames a tensor changes what the server answers.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import real_sglang
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_client import SGLangClient

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 12, 30, 31, 4]]


def weights_of(seed: int) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of the test checkpoint's architecture with weights drawn from `seed`."""
    return list(reference_model(seed).state_dict().items())


_MODELS: dict[int, torch.nn.Module] = {}


def reference_model(seed: int):
    from megatron_rl.data.char_tokenizer import build_char_tokenizer
    from megatron_rl.models.tiny import make_tiny_hf_model

    if seed not in _MODELS:
        tok = build_char_tokenizer()
        _MODELS[seed] = make_tiny_hf_model("qwen2", None, seed=seed, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return _MODELS[seed]


def greedy(seed: int, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Argmax tokens and their log-probs (T=1 distribution) from a plain forward per step."""
    model, out, logprobs = reference_model(seed), [], []
    with torch.no_grad():
        for _ in range(steps):
            logp = model(torch.tensor([prompt + out])).logits[0, -1].float().log_softmax(-1)
            token = int(logp.argmax())
            out.append(token)
            logprobs.append(float(logp[token]))
    return out, logprobs


def greedy_from_folder(folder, prompt: list[int], steps: int) -> list[int]:
    """Argmax tokens of a saved HF checkpoint (the servers' starting weights)."""
    from transformers import AutoModelForCausalLM

    model, out = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def buckets(seed: int, count: int = 2) -> list[list[tuple[str, torch.Tensor]]]:
    named = weights_of(seed)
    step = -(-len(named) // count)
    return [named[i:i + step] for i in range(0, len(named), step)]


def push(transport, engine, seed: int) -> int:
    version = engine.weight_version + 1
    transport.begin(version)
    for bucket in buckets(seed):
        transport.send(bucket, version)
    transport.finish(version)
    return version


def assert_serves(engine, seed: int, steps: int = 8) -> None:
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True))
    for sample, prompt in zip(samples, PROMPTS):
        tokens, logprobs = greedy(seed, prompt, steps)
        assert sample.response_ids == tokens, (seed, prompt)
        assert sample.rollout_logprobs == pytest.approx(logprobs, abs=2e-4)
        assert sample.finish_reason == "length"


def test_tensor_transport_cpu_tensors_reach_the_server_and_meta_info_carries_the_version(real_engine):
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    transport = SGLangTensorTransport(real_engine, check=True)
    version = push(transport, real_engine, seed=11)
    assert_serves(real_engine, seed=11)
    names = [n for n, _ in weights_of(11)]
    assert set(transport.checksums(names)) == set(names)  # /weights_checker: replicas agree, weights moved
    # the raw answer the engine reads (srt/managers/tokenizer_manager.py meta_info)
    raw = real_engine.servers[0].client.post("/generate", {
        "input_ids": PROMPTS[0], "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True})
    tokens, logprobs = greedy(11, PROMPTS[0], 3)
    meta = raw["meta_info"]
    assert raw["output_ids"] == tokens
    assert meta["weight_version"] == str(version) and meta["finish_reason"] == {"type": "length", "length": 3}
    assert [e[1] for e in meta["output_token_logprobs"]] == tokens
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(logprobs, abs=2e-4)
    assert meta["weight_versions"] == [{"version": str(version), "start": 0, "end": 3}]  # per-token spans
    assert real_engine.servers[0].client.get("/model_info")["weight_version"] == str(version)


def test_a_stop_token_ends_the_sample_unless_ignore_eos(real_engine):
    """SGLang's stop check (srt/managers/schedule_batch.py `_check_token_based_finish`) returns early
    under ignore_eos: then stop_token_ids do not end a sample either."""
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    push(SGLangTensorTransport(real_engine), real_engine, seed=12)
    tokens, _ = greedy(12, PROMPTS[1], 8)
    stop, eos = tokens[3], reference_model(12).config.eos_token_id
    cut = next(i for i, t in enumerate(tokens) if t in (stop, eos)) + 1  # the stop token is kept
    (sample,) = real_engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                                  stop_token_ids=[stop]))
    assert sample.response_ids == tokens[:cut] and sample.finish_reason == "stop"
    (sample,) = real_engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                                  stop_token_ids=[stop], ignore_eos=True))
    assert sample.response_ids == tokens and sample.finish_reason == "length"


def test_disk_transport_publishes_a_version_the_server_loads(real_engine, real_model, tmp_path):
    from megatron_rl.sync.disk_transport import DiskTransport

    transport = DiskTransport(real_engine, tmp_path / "weights", template_dir=real_model)
    version = push(transport, real_engine, seed=13)
    assert (tmp_path / "weights" / f"v{version:06d}").is_dir()
    assert_serves(real_engine, seed=13)
    assert real_engine.servers[0].client.get("/model_info")["weight_version"] == str(version)


def test_distributed_transport_broadcasts_over_gloo(real_engine):
    from megatron_rl.sync.sglang_transport import SGLangNcclTransport
    from sglang_testing import free_port_block

    transport = SGLangNcclTransport(real_engine, "127.0.0.1", free_port_block(2), backend="gloo", device="cpu",
                                    check=True, timeout_s=60)
    try:
        push(transport, real_engine, seed=14)
        assert_serves(real_engine, seed=14)
        push(transport, real_engine, seed=15)  # the group formed once is used again
        assert_serves(real_engine, seed=15)
    finally:
        transport.close()


def test_release_and_resume_around_a_sync(real_engine):
    """Released weights stay on CPU here (no memory saver without CUDA), so this shows the calls and
    their order are accepted; that the GPU copy is discarded only a GPU can show."""
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    real_engine.release_memory()
    real_engine.resume_memory()
    push(SGLangTensorTransport(real_engine), real_engine, seed=16)
    assert_serves(real_engine, seed=16)


# As long as the tiny model's 256 positions allow: on an idle CPU the server decodes it in well under
# a second, and the pause must reach it while it is still decoding.
LONG = SamplingParams(temperature=0.0, max_new_tokens=240, ignore_eos=True)


def _generate_in_background(engine):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(engine.generate([PROMPTS[0]], LONG)), daemon=True)
    thread.start()
    return thread, out


def _running(engine) -> bool:
    """A request is inside the server: /flush_cache is refused (400) while one runs."""
    from megatron_rl.rollout.sglang_client import SGLangHTTPError

    try:
        engine.servers[0].client.post("/flush_cache")
        return False
    except SGLangHTTPError as err:
        return err.status == 400


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_a_sync_during_generation_in_each_pause_mode(real_engine, monkeypatch, mode):
    """abort: the request in flight ends with finish_reason abort; the engine retries it on the new
    weights, so the sample is wholly from them. retract: the request is kept and finishes after the
    update, its first tokens from the old weights (meta_info weight_versions has both spans); the
    engine accepts it, which is what pause_mode=retract trades for not recomputing."""
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    transport = SGLangTensorTransport(real_engine)
    old = push(transport, real_engine, seed=17)
    monkeypatch.setattr(real_engine.cfg, "pause_mode", mode)
    retries = real_engine.stats["retries"]
    thread, out = _generate_in_background(real_engine)
    real_sglang.wait_for(lambda: _running(real_engine), 30, "the long request to start")
    time.sleep(0.05)  # some tokens from the old weights, well before the last
    new = push(transport, real_engine, seed=18)
    thread.join(120)
    (sample,) = out[0]
    old_tokens, _ = greedy(17, PROMPTS[0], LONG.max_new_tokens)
    new_tokens, _ = greedy(18, PROMPTS[0], LONG.max_new_tokens)
    assert len(sample.response_ids) == LONG.max_new_tokens
    if mode == "abort":
        assert real_engine.stats["retries"] == retries + 1
        assert sample.response_ids == new_tokens
    else:
        assert real_engine.stats["retries"] == retries
        mixed = next(i for i, (a, b) in enumerate(zip(sample.response_ids, old_tokens)) if a != b)
        assert 0 < mixed < LONG.max_new_tokens  # old weights up to the pause, then the new ones
        assert sample.response_ids != new_tokens
    assert real_engine.weight_version == new > old


def test_pause_in_place_keeps_the_request_so_the_sync_cannot_flush(real_engine, monkeypatch):
    """in_place keeps the paused request in the running batch, and SGLang refuses /flush_cache while
    any request is there: the engine's sync (pause, then flush) fails after its flush retries."""
    from megatron_rl.rollout.sglang_client import SGLangHTTPError
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    transport = SGLangTensorTransport(real_engine)
    push(transport, real_engine, seed=19)
    monkeypatch.setattr(real_engine.cfg, "pause_mode", "in_place")
    monkeypatch.setattr(real_engine.cfg, "flush_retries", 3)
    thread, out = _generate_in_background(real_engine)
    real_sglang.wait_for(lambda: _running(real_engine), 30, "the long request to start")
    with pytest.raises(SGLangHTTPError) as err:
        transport.begin(real_engine.weight_version + 1)
    assert err.value.status == 400 and "Flush cache failed" in err.value.body
    real_engine.resume()  # what an operator would do: the kept request then finishes
    thread.join(120)
    (sample,) = out[0]
    assert sample.response_ids == greedy(19, PROMPTS[0], LONG.max_new_tokens)[0]


def test_an_open_session_left_by_a_failed_sync_is_closed_by_the_next(real_engine):
    """The engine recognises SGLang's "already open" refusal and closes the stale session."""
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    client: SGLangClient = real_engine.servers[0].client
    assert client.post("/begin_weight_update")["success"]  # a sync that died after opening it
    push(SGLangTensorTransport(real_engine), real_engine, seed=20)
    assert_serves(real_engine, seed=20)
