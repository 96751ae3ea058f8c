"""Two launched server doubles: each samples from its own seed, and rows travel in batches.

Without --enable-deterministic-inference SGLang ignores a row's sampling_seed (srt/sampling/
sampling_batch_info.py) and draws from the server's generator (--random-seed): servers with one seed
answer one prompt with the same tokens, and a per-row seed only splits every row into its own
HTTP request."""

from __future__ import annotations

import pytest

from sglang_testing import DOUBLES_TIMEOUT_S, make_engine, needs_sglang_source

from megatron_rl.rollout.base import SamplingParams

pytestmark = [needs_sglang_source, pytest.mark.timeout(DOUBLES_TIMEOUT_S)]

PROMPTS = [[3, 17, 42, 5], [9, 9, 1], [60, 2, 33, 7, 11]]


@pytest.fixture(scope="module")
def engine(qwen2_dir):
    eng = make_engine(qwen2_dir, num_servers=2, max_batch_per_request=4, requests_per_server=2)
    yield eng
    eng.shutdown()


def rows_per_request(engine) -> list[list[int]]:
    return [s.client.get("/_double/generate_rows") for s in engine.servers]


def test_two_servers_answer_one_prompt_with_different_samples(engine):
    """What a group's samples on two servers see: one request each, same prompt, same params."""
    body = {"input_ids": PROMPTS[0], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}}
    first = [s.client.post("/generate", body)["output_ids"] for s in engine.servers]
    assert first[0] != first[1]


def test_a_groups_samples_spread_one_per_request_over_the_servers_differ(engine, monkeypatch):
    """pass@k's k samples (or a group's n) sent one row per request, as the servers' least-busy
    choice spreads them: each server draws from its own seed, so no two samples are the same."""
    monkeypatch.setattr(engine.cfg, "max_batch_per_request", 1)
    before = [len(r) for r in rows_per_request(engine)]
    samples = engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=12, n=4, ignore_eos=True))
    new = [r[b:] for r, b in zip(rows_per_request(engine), before)]
    assert all(new), new  # both servers drew some of them
    drawn = [tuple(s.response_ids) for s in samples]
    assert len(set(drawn)) == 4, drawn


def test_rows_travel_in_batches_without_deterministic_inference(engine):
    before = [len(r) for r in rows_per_request(engine)]
    samples = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=3, n=4, seed=11,
                                                      ignore_eos=True))
    assert [s.prompt_index for s in samples] == [i for i in range(3) for _ in range(4)]
    new = [r[b:] for r, b in zip(rows_per_request(engine), before)]
    # 12 rows, one sampling_params (no per-row seed), at most max_batch_per_request=4 a request
    assert sorted(n for r in new for n in r) == [4, 4, 4]
    for group in range(3):  # a prompt's 4 samples, drawn in one batch from one generator
        drawn = [tuple(s.response_ids) for s in samples[4 * group:4 * group + 4]]
        assert len(set(drawn)) == 4, drawn


def test_rows_go_one_per_request_only_under_deterministic_inference(engine, monkeypatch):
    monkeypatch.setattr(engine.cfg, "deterministic_inference", True)  # then each row's seed is honoured
    before = [len(r) for r in rows_per_request(engine)]
    engine.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=2, n=3, seed=11, ignore_eos=True))
    new = [r[b:] for r, b in zip(rows_per_request(engine), before)]
    assert sorted(n for r in new for n in r) == [1] * 6
