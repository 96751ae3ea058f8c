"""The engine behind the router double: /generate bodies the gateway accepts, its cache-aware routing,
and refusals (4xx) reported once instead of retried."""

from __future__ import annotations

import logging
import sys

import pytest

from router_protocol import CacheAware, Unprocessable, parse_generate
from sglang_testing import (DOUBLES_TIMEOUT_S, ROUTER_COMMAND, START_S, free_port_block, make_engine,
                            needs_sglang_source)

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout import sglang_engine as engine_mod
from megatron_rl.rollout.sglang_client import SGLangClient, SGLangHTTPError
from megatron_rl.rollout.sglang_config import SGLangConfig
from megatron_rl.rollout.sglang_engine import RolloutRequestError, RolloutUnavailableError, SGLangEngine, request_chunks

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
    def list_body(rows, sampling, per_row_seed=True):  # the body before the fix: one sampling_params entry per row
        return {"input_ids": [p for _, p, _ in rows], "return_logprob": True,
                "sampling_params": [engine_mod.row_sampling_params(r, sampling) for r in rows]}

    monkeypatch.setattr(engine_mod, "_generate_body", list_body)
    retries = routed.stats["retries"]
    with pytest.raises(RolloutRequestError, match="HTTP 422 .*not retried.*single sampling_params"):
        routed.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, n=2))
    assert routed.stats["retries"] == retries


def router_over(routed, **cfg_kw) -> SGLangConfig:
    """A second router, launched by a new engine, in front of the `routed` fixture's servers."""
    cfg_kw.setdefault("router_command", ROUTER_COMMAND)
    return SGLangConfig(server_urls=[s.url for s in routed.servers], launch_router=True,
                        router_port=free_port_block(1), **cfg_kw)


def assert_the_client_gives_up_first(engine, routed, caplog) -> None:
    """A /generate stuck on a paused worker (the double holds it, as SGLang does) ends at the client's
    request_timeout_s, logged as the client's timeout, not as the router's 504 at its longer limit;
    with max_retries=0 it is then reported. The workers are resumed whatever happens."""
    try:
        for server in routed.servers:
            server.client.post("/pause_generation", {"mode": "in_place"})
        caplog.set_level(logging.WARNING, logger="megatron_rl.rollout.sglang")
        with pytest.raises(RolloutUnavailableError, match="a /generate request failed 1 times"):
            engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
        failures = [r.getMessage() for r in caplog.records if "generate on" in r.getMessage()]
        assert len(failures) == 1 and "timed out" in failures[0] and "HTTP 504" not in failures[0], failures
    finally:
        for server in routed.servers:
            server.client.post("/continue_generation", {})


@needs_sglang_source
@pytest.mark.timeout(DOUBLES_TIMEOUT_S)
def test_a_launched_router_logs_into_the_log_dir_takes_the_key_and_the_client_gives_up_first(
        routed, tmp_path, caplog):
    """The router's own output lands in <log_dir>/sglang_router.log; the gateway answers 401 to a
    /generate without the key; a request stuck on a paused worker ends at the client's
    request_timeout_s (then retried or reported), not at the router's longer timeout."""
    cfg = router_over(routed, request_timeout_s=2.0, router_request_timeout_s=90.0, max_retries=0,
                      startup_timeout_s=START_S)
    engine = SGLangEngine(cfg, "served-by-the-urls", log_dir=tmp_path)
    try:
        assert f"sglang router double on 127.0.0.1:{cfg.router_port}" in (tmp_path / "sglang_router.log").read_text()
        with pytest.raises(SGLangHTTPError) as refused:
            SGLangClient(engine.router.url, "not-the-key").post("/generate", {"input_ids": [1, 2]})
        assert refused.value.status == 401
        samples = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert [len(s.response_ids) for s in samples] == [2, 2]

        assert_the_client_gives_up_first(engine, routed, caplog)
    finally:
        engine.shutdown()
    assert not engine._router_proc.alive()


@needs_sglang_source
@pytest.mark.timeout(DOUBLES_TIMEOUT_S)
def test_a_router_that_exits_at_startup_is_named_with_the_end_of_its_log(routed, tmp_path):
    """Not a wait for startup_timeout_s: the router's process is watched like a server's."""
    exits = [sys.executable, "-c", "import sys; print('error: unexpected argument --policy'); sys.exit(2)"]
    cfg = router_over(routed, router_command=exits, startup_timeout_s=60.0)
    with pytest.raises(RuntimeError) as failed:
        SGLangEngine(cfg, "served-by-the-urls", log_dir=tmp_path)
    log = tmp_path / "sglang_router.log"
    assert str(failed.value) == (f"SGLang server http://127.0.0.1:{cfg.router_port} exited during startup "
                                 f"(exit code 2); the end of {log}:\nerror: unexpected argument --policy")


@needs_sglang_source
@pytest.mark.timeout(DOUBLES_TIMEOUT_S)
def test_a_router_given_by_url_carries_the_requests_the_key_and_the_client_timeout(routed, caplog):
    """rollout.sglang.router_url (a gateway started elsewhere): every /generate goes through it with
    the key, and a request stuck on a paused worker ends at the client's request_timeout_s."""
    cfg = SGLangConfig(server_urls=[s.url for s in routed.servers], router_url=routed.router.url,
                       request_timeout_s=2.0, max_retries=0)
    engine = SGLangEngine(cfg, "served-by-the-urls")
    before = sum(routed.router.get("/double/routed").values())
    samples = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert [len(s.response_ids) for s in samples] == [2, 2]
    assert sum(routed.router.get("/double/routed").values()) == before + 1  # one request: the rows share params
    assert engine.stats["requests"] == 1
    assert_the_client_gives_up_first(engine, routed, caplog)
