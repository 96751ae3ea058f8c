"""The engine behind the router double: /generate bodies the gateway accepts, its cache-aware routing,
and refusals (4xx) reported once instead of retried."""

from __future__ import annotations

import pytest

from router_protocol import CacheAware, Unprocessable, parse_generate
from sglang_testing import DOUBLES_TIMEOUT_S, free_port_block, make_engine, needs_sglang_source

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout import sglang_engine as engine_mod
from megatron_rl.rollout.sglang_engine import RolloutRequestError, request_chunks

PROMPTS = [[3, 17, 42, 5], [9, 9, 1], [60, 2, 33, 7, 11], [4], [80, 81], [5, 6, 7]]


def test_router_double_refuses_a_list_of_sampling_params_and_drops_unknown_fields():
    with pytest.raises(Unprocessable, match="sampling_params: invalid type: sequence"):
        parse_generate({"input_ids": [[1, 2], [3]], "sampling_params": [{"temperature": 1.0}] * 2})
    with pytest.raises(Unprocessable, match="max_new_tokens"):  # u32 in sampling_params.rs
        parse_generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}})
    out = parse_generate({"input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0.5, "foo": 1},
                          "return_logprob": True, "logprob_start_len": -1, "not_a_field": 3})
    assert out["sampling_params"] == {"temperature": 0.5} and "not_a_field" not in out
    assert (out["input_ids"], out["return_logprob"], out["log_metrics"], out["stream"]) == ([[1, 2], [3]], True, True, False)


def test_cache_aware_routes_misses_to_the_smallest_tree_and_hits_to_their_worker():
    policy = CacheAware(["a", "b"])
    load = {"a": 0, "b": 0}
    # By hand: empty trees (size 1 each) -> "a"; a's tree now holds "1 2 3"'s 6 prefixes -> "b" is smaller.
    assert policy.select("1 2 3", load) == "a"
    assert policy.select("7 8 9", load) == "b"
    assert policy.select("1 2 3 4", load) == "a"  # 5/7 chars match a's tree (> 0.3)
    assert policy.select("7 8 9 9", load) == "b"
    # Imbalance (100 - 10 > 64 and 100 > 1.5 x 10): the least loaded, whatever the cache says.
    assert policy.select("1 2 3", {"a": 100, "b": 10}) == "b"


def test_requests_never_mix_sampling_params_and_keep_row_order():
    rows = [(i, p, r) for i, p in enumerate(PROMPTS) for r in range(2)]
    unseeded = request_chunks(rows, SamplingParams(n=2, max_new_tokens=4), max_rows=4)
    assert [len(c) for c in unseeded] == [4, 4, 4] and [r for c in unseeded for r in c] == rows
    seeded = request_chunks(rows, SamplingParams(n=2, max_new_tokens=4, seed=3), max_rows=4)
    assert [len(c) for c in seeded] == [1] * len(rows)  # a sampling_seed per row: one row per request


@pytest.fixture(scope="module")
def routed(qwen2_dir):
    base = free_port_block(3)
    eng = make_engine(qwen2_dir, num_servers=2, base_port=base, launch_router=True, router_port=base + 2,
                      max_batch_per_request=2, requests_per_server=1)
    yield eng
    eng.shutdown()


@needs_sglang_source
@pytest.mark.timeout(DOUBLES_TIMEOUT_S)
def test_generate_through_the_router_reaches_both_servers(routed):
    samples = routed.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=3, n=2, ignore_eos=True))
    assert [s.prompt_index for s in samples] == [i for i in range(len(PROMPTS)) for _ in range(2)]
    assert all(len(s.response_ids) == 3 for s in samples)
    routed_counts = routed.router.get("/double/routed")
    assert sum(routed_counts.values()) == 6 and min(routed_counts.values()) > 0, routed_counts


@needs_sglang_source
@pytest.mark.timeout(DOUBLES_TIMEOUT_S)
def test_a_refused_request_is_reported_once_not_retried(routed, monkeypatch):
    def list_body(rows, sampling):  # the body before the fix: one sampling_params entry per row
        return {"input_ids": [p for _, p, _ in rows], "return_logprob": True,
                "sampling_params": [engine_mod.row_sampling_params(r, sampling) for r in rows]}

    monkeypatch.setattr(engine_mod, "_generate_body", list_body)
    retries = routed.stats["retries"]
    with pytest.raises(RolloutRequestError, match="HTTP 422 .*not retried.*single sampling_params"):
        routed.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, n=2))
    assert routed.stats["retries"] == retries
