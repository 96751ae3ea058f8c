"""Value tests of the HTTP reward against a real http.server on 127.0.0.1: what the config's knobs
become in the client and the runner that wraps it (one POST per batch whatever reward.num_workers,
the runner's wait covering every attempt), the backoff actually slept, each sample's reward in its
own position with several requests in flight and answered out of order, and what counts as an
error (a whole batch after the last attempt, one sample for one bad value). Expected values by hand."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.config import load_config
from megatron_rl.data.datasets import PromptItem
from megatron_rl.loop.build import build_rewards
from megatron_rl.loop.sampling import score_texts
from megatron_rl.rewards import http as http_mod
from megatron_rl.rewards.http import HttpReward, RewardServerError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from loopback_http import LoopbackHttp, send_json  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class Server(LoopbackHttp):
    """Scores each response as float(len(response)) unless the request's first extra row says
    otherwise: {"delay": s} sleeps s seconds first, {"status": code} answers that code,
    {"reply": obj} answers obj. Records bodies in arrival order and the order replies were sent."""

    def __init__(self, script=()):
        self.sent, self.script = [], list(script)
        super().__init__(self._respond)

    def _respond(self, handler, body):
        action = self.script.pop(0) if self.script else (body["extra"][0] if body["extra"] else {})
        time.sleep(action.get("delay", 0.0))
        if "status" in action:
            handler.send_response(action["status"])
            handler.end_headers()
            return
        reply = action.get("reply", {"rewards": [float(len(r)) for r in body["responses"]]})
        if send_json(handler, json.dumps(reply).encode()):
            self.sent.append(body["responses"][0] if body["responses"] else None)


@pytest.fixture()
def server():
    made = []

    def make(script=()):
        made.append(Server(script))
        return made[-1]
    yield make
    for s in made:
        s.close()


def _runner(url, *overrides):
    return build_rewards(load_config(None, [f"reward.url={url}", *overrides]))


def test_the_config_knobs_reach_the_client_and_the_runner_waits_for_every_attempt(server):
    s = server()
    runner = _runner(s.url, "reward.timeout_s=0.7", "reward.max_retries=3", "reward.retry_backoff_s=0.25",
                     "reward.num_workers=4")
    try:
        remote = runner.fn
        assert (remote.url, remote.timeout_s, remote.max_retries, remote.backoff_s) == (s.url, 0.7, 3, 0.25)
        # 4 attempts of 0.7 s, sleeps 0.25 + 0.5 + 1.0 between them, 5 s of slack for the worker
        assert runner.timeout_s == pytest.approx(4 * 0.7 + 1.75 + 5.0)
        assert runner.batched
        responses = [f"r{'x' * i}" for i in range(9)]
        rewards, stats = runner.score(responses, ["a"] * 9)
    finally:
        runner.close()
    assert rewards == [float(1 + i) for i in range(9)]  # each in its own position
    assert stats == {"num_errors": 0, "num_timeouts": 0}
    assert [b["responses"] for b in s.bodies] == [responses]  # one POST for the batch, 4 workers or not


def test_an_eval_datasets_own_reward_is_local_even_with_a_url(server):
    s = server()
    runner = build_rewards(load_config(None, [f"reward.url={s.url}"]), name="exact_match")
    try:
        assert not isinstance(runner.fn, HttpReward) and not runner.batched
        assert runner.score(["7", "8"], ["7", "7"])[0] == [1.0, 0.0]
    finally:
        runner.close()
    assert s.bodies == []


def test_the_backoff_slept_doubles_from_retry_backoff_s(server, monkeypatch):
    s = server([{"status": 503}, {"status": 429}, {"status": 502}, {}])
    slept = []
    monkeypatch.setattr(http_mod, "time", SimpleNamespace(sleep=slept.append))  # the client's sleeps only
    assert HttpReward(s.url, timeout_s=5.0, max_retries=3, backoff_s=0.3)(["ab", "c"], ["", ""]) == [2.0, 1.0]
    assert slept == [0.3, 0.6, 1.2] and len(s.bodies) == 4
    assert HttpReward(s.url, timeout_s=2.0, max_retries=0, backoff_s=0.3).max_budget_s() == 2.0  # no retry, no sleep


def test_each_caller_gets_its_own_rewards_when_replies_come_back_out_of_order(server):
    s = server()
    remote = HttpReward(s.url, timeout_s=10.0, max_retries=0)
    batches = {"slow": (["s", "ss", "sss"], 0.8), "mid": (["mmmm", "m"], 0.4), "fast": (["ffffff", "ff", "f"], 0.0)}
    out = {}

    def call(name):
        responses, delay = batches[name]
        out[name] = remote(responses, [""] * len(responses), delay=[delay] * len(responses))

    # The extra column is the server's script: every row's "delay" is the request's first row.
    threads = [threading.Thread(target=call, args=(n,)) for n in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.sent == ["ffffff", "mmmm", "s"]  # three in flight, answered fastest first
    assert out == {"slow": [1.0, 2.0, 3.0], "mid": [4.0, 1.0], "fast": [6.0, 2.0, 1.0]}


def test_one_non_finite_or_malformed_value_zeroes_its_own_sample_only(server):
    s = server([{"reply": {"rewards": [1.5, "NaN", {"score": 2.0, "fmt": 1.0}, {"no": 1}, 0.25]}}])
    runner = _runner(s.url, "reward.max_retries=0")
    try:
        rewards, stats = runner.score(list("abcde"), ["x"] * 5)
    finally:
        runner.close()
    assert rewards == [1.5, 0.0, 2.0, 0.0, 0.25]
    assert stats["num_errors"] == 2 and stats["num_timeouts"] == 0
    assert stats["components"] == {"fmt": [0.0, 0.0, 1.0, 0.0, 0.0]}


@pytest.mark.parametrize("reply", [{"rewards": [1.0]}, [1.0, 2.0, 3.0], {"scores": [1.0, 2.0]}])
def test_a_reply_of_the_wrong_length_fails_at_once_and_zeroes_the_batch(server, reply):
    s = server([{"reply": reply}])
    with pytest.raises(RewardServerError, match="expected 2 rewards"):
        HttpReward(s.url, timeout_s=5.0, max_retries=3, backoff_s=0.01)(["a", "b"], ["", ""])
    assert len(s.bodies) == 1  # not retried
    s.script = [{"reply": reply}]
    runner = _runner(s.url, "reward.max_retries=3", "reward.retry_backoff_s=0.01")
    try:
        assert runner.score(["a", "b"], ["", ""]) == ([0.0, 0.0], {"num_errors": 2, "num_timeouts": 0})
    finally:
        runner.close()


def test_an_endpoint_that_times_out_on_every_attempt_counts_every_sample_as_an_error(server):
    s = server([{"delay": 3.0}, {"delay": 3.0}])
    runner = _runner(s.url, "reward.timeout_s=0.5", "reward.max_retries=1", "reward.retry_backoff_s=0.01")
    try:
        rewards, stats = runner.score(["a", "b", "c"], ["", "", ""])
        assert rewards == [0.0, 0.0, 0.0] and stats == {"num_errors": 3, "num_timeouts": 0}  # docs/rewards.md
        assert len(s.bodies) == 2  # the attempt and its one retry
        assert runner.score(["abc"], [""]) == ([3.0], {"num_errors": 0, "num_timeouts": 0})  # back: the next batch
    finally:
        runner.close()


def test_the_loops_scoring_sends_each_samples_answer_and_prompt_in_order(server):
    s = server()
    runner = _runner(s.url)
    prompts = [PromptItem([1], "<p0>", "A0", 0, {"level": 1}), PromptItem([2], "<p1>", "A1", 1, {"level": 2})]
    try:
        rewards, stats = score_texts(runner, prompts, ["x", "xx", "xxx", "xxxx"], n=2)
    finally:
        runner.close()
    assert rewards == [1.0, 2.0, 3.0, 4.0]
    assert s.bodies == [{"responses": ["x", "xx", "xxx", "xxxx"], "answers": ["A0", "A0", "A1", "A1"],
                         "extra": [{"level": 1, "prompt": "<p0>"}, {"level": 1, "prompt": "<p0>"},
                                   {"level": 2, "prompt": "<p1>"}, {"level": 2, "prompt": "<p1>"}]}]
