"""Retry loops of the SGLang engine at their boundaries: zero retries; exactly the allowed number of
failures then success; one failure more: the error.

A fault-injecting relay sits between SGLangEngine and one server double: it answers the first K
requests to a path with an error status and forwards everything else unchanged, so every answer the
engine accepts comes from the double. Loops covered: /generate (`rollout.sglang.max_retries`: HTTP
5xx is retried, 4xx is not) and /flush_cache (`rollout.sglang.flush_retries`: HTTP 400 while
requests run is retried).
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from collections import Counter
from http.server import ThreadingHTTPServer

import pytest

from double_http import QuietHandler
from sglang_testing import API_KEY, DOUBLES_TIMEOUT_S, start_double

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_client import SGLangHTTPError
from megatron_rl.rollout.sglang_config import SGLangConfig
from megatron_rl.rollout.sglang_engine import RolloutRequestError, RolloutUnavailableError, SGLangEngine

pytestmark = pytest.mark.timeout(DOUBLES_TIMEOUT_S)

# No seed: the rows share one sampling_params object, so they travel in one /generate (per-row
# seeds would make every row its own request: sglang_engine.request_chunks).
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=3, n=2, ignore_eos=True)
PROMPTS = [[3, 17, 42], [9, 9, 1, 4]]


class Faults:
    """What the relay injects: path -> [failures left, HTTP status, body]; and what it saw."""

    def __init__(self) -> None:
        self.plan: dict[str, list[int]] = {}
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()

    def fail(self, path: str, times: int, status: int, body: str = "injected failure") -> None:
        with self.lock:
            self.plan[path] = [times, status, body]
            self.seen.clear()

    def take(self, path: str) -> tuple[int, str] | None:
        with self.lock:
            self.seen[path] += 1
            left = self.plan.get(path)
            if left and left[0] > 0:
                left[0] -= 1
                return left[1], left[2]
            return None


def _relay(upstream: str, faults: Faults) -> ThreadingHTTPServer:
    class Relay(QuietHandler):
        def do_GET(self):
            self._forward("GET", None)

        def do_POST(self):
            self._forward("POST", self.body())

        def _forward(self, method: str, data: bytes | None) -> None:
            fault = faults.take(self.path.split("?")[0])
            if fault is not None:
                return self.reply(*fault)
            headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
            req = urllib.request.Request(upstream + self.path, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    self.reply(resp.status, resp.read())
            except urllib.error.HTTPError as err:
                self.reply(err.code, err.read())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def relay(qwen2_dir):
    proc, url = start_double(qwen2_dir)
    faults = Faults()
    server = _relay(url, faults)
    yield f"http://127.0.0.1:{server.server_address[1]}", faults
    server.shutdown()
    proc.kill()
    proc.wait()


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", API_KEY)


def _engine(relay, path: str, failures: int, status: int, body: str = "injected failure",
            **kw) -> tuple[SGLangEngine, Faults]:
    """An engine attached through the relay, whose next `failures` requests to `path` get `status`
    with `body`."""
    url, faults = relay
    engine = SGLangEngine(SGLangConfig(server_urls=[url], request_timeout_s=60, max_batch_per_request=8, **kw),
                          "unused")
    faults.fail(path, failures, status, body)
    return engine, faults


@pytest.mark.parametrize("max_retries,failures,ok", [(0, 0, True), (0, 1, False), (2, 2, True), (2, 3, False)])
def test_generate_is_retried_exactly_max_retries_times(relay, max_retries, failures, ok):
    engine, faults = _engine(relay, "/generate", failures, 503, max_retries=max_retries)
    if ok:
        samples = engine.generate(PROMPTS, SAMPLING)
        assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
        assert all(len(s.response_ids) == 3 for s in samples)
        assert engine.stats["retries"] == failures
    else:
        with pytest.raises(RolloutUnavailableError, match=f"failed {max_retries + 1} times"):
            engine.generate(PROMPTS, SAMPLING)
        assert engine.stats["retries"] == max_retries + 1
    # one request per attempt (all rows fit one request): no extra attempt after success or the last failure
    assert faults.seen["/generate"] == (failures + 1 if ok else max_retries + 1)


def test_a_client_error_is_not_retried(relay):
    engine, faults = _engine(relay, "/generate", 1, 422, max_retries=3)
    with pytest.raises(RolloutRequestError, match="HTTP 422"):
        engine.generate(PROMPTS, SAMPLING)
    assert faults.seen["/generate"] == 1 and engine.stats["retries"] == 0


@pytest.mark.parametrize("flush_retries,refusals,ok", [(1, 0, True), (1, 1, False), (3, 2, True), (3, 3, False)])
def test_flush_cache_is_tried_exactly_flush_retries_times(relay, caplog, flush_retries, refusals, ok):
    refusal = "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 1 (waiting: 12)"
    engine, faults = _engine(relay, "/flush_cache", refusals, 400, f"  {refusal}\n", flush_retries=flush_retries)
    with caplog.at_level(logging.INFO, logger="megatron_rl.rollout.sglang"):
        if ok:
            engine.flush_cache(retry_s=0.01)
        else:
            with pytest.raises(SGLangHTTPError, match="HTTP 400"):
                engine.flush_cache(retry_s=0.01)
    assert faults.seen["/flush_cache"] == (refusals + 1 if ok else flush_retries)
    retried = refusals if ok else flush_retries - 1  # each refusal but the last one is logged and retried
    assert [r.getMessage() for r in caplog.records if "flush_cache" in r.getMessage()] == (
        [f"{relay[0]}: flush_cache refused ({refusal[:80]}); retrying"] * retried)


def test_flush_cache_does_not_retry_other_errors(relay):
    engine, faults = _engine(relay, "/flush_cache", 1, 500, flush_retries=5)
    with pytest.raises(SGLangHTTPError, match="HTTP 500"):
        engine.flush_cache(retry_s=0.01)
    assert faults.seen["/flush_cache"] == 1
