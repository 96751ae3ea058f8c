"""The HTTP reward against a loopback server started here: the JSON contract, retries at their
boundaries, a server that times out, and containment in the RewardRunner."""

import json
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.rewards import HttpReward, RewardRunner
from megatron_rl.rewards.http import RewardServerError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from loopback_http import LoopbackHttp, send_json  # noqa: E402


class Server(LoopbackHttp):
    """Answers POSTs by script: each entry is "ok", an HTTP status int, "slow" (sleeps past the
    client timeout) or "bad_json"; after the script it answers "ok". Records every request body."""

    def __init__(self, script=()):
        self.script = list(script)
        super().__init__(self._respond)

    def _respond(self, handler, body):
        action = self.script.pop(0) if self.script else "ok"
        if action == "slow":
            time.sleep(10.0)
        if isinstance(action, int):
            handler.send_response(action)
            handler.end_headers()
            return
        send_json(handler, b"not json" if action == "bad_json" else json.dumps({"rewards": [
            {"score": float(r == a), "len": float(len(r)), "pred": r} if e.get("dict") else float(r == a)
            for r, a, e in zip(body["responses"], body["answers"], body["extra"])]}).encode())


@pytest.fixture()
def server_factory():
    made = []

    def make(script=()):
        made.append(Server(script))
        return made[-1]
    yield make
    for s in made:
        s.close()


def test_json_contract_and_dict_rewards(server_factory):
    server = server_factory()
    reward = HttpReward(server.url, timeout_s=5.0, max_retries=0)
    out = reward(["a", "bb"], ["a", "x"], dict=[True, False], level=[1, 2])
    assert out == [{"score": 1.0, "len": 1.0, "pred": "a"}, 0.0]
    assert server.bodies == [{"responses": ["a", "bb"], "answers": ["a", "x"],
                              "extra": [{"dict": True, "level": 1}, {"dict": False, "level": 2}]}]


@pytest.mark.parametrize("retries,failures,ok", [(0, 0, True), (0, 1, False), (2, 2, True), (2, 3, False)])
def test_retry_boundaries(server_factory, retries, failures, ok):
    server = server_factory([503] * failures)
    reward = HttpReward(server.url, timeout_s=5.0, max_retries=retries, backoff_s=0.01)
    if ok:
        assert reward(["a"], ["a"]) == [1.0]
    else:
        with pytest.raises(RewardServerError, match=f"failed after {retries + 1} attempts: HTTP 503"):
            reward(["a"], ["a"])
    assert len(server.bodies) == min(failures, retries) + 1


def test_client_errors_are_not_retried(server_factory):
    for script, message in (([400], "HTTP 400"), (["bad_json"], "not JSON")):
        server = server_factory(script)
        with pytest.raises(RewardServerError, match=message):
            HttpReward(server.url, timeout_s=5.0, max_retries=3, backoff_s=0.01)(["a"], ["a"])
        assert len(server.bodies) == 1


def test_timeout_is_retried_then_succeeds(server_factory):
    server = server_factory(["slow"])
    start = time.monotonic()
    # 2 s: a loaded host stalls for seconds, and the retry must be answered within it
    assert HttpReward(server.url, timeout_s=2.0, max_retries=1, backoff_s=0.01)(["a"], ["b"]) == [0.0]
    assert len(server.bodies) == 2 and time.monotonic() - start < 8.0  # the timeout and a retry, not the 10 s sleep


def test_failing_server_is_contained_by_the_runner(server_factory):
    server = server_factory(["slow", "slow"])
    remote = HttpReward(server.url, timeout_s=2.0, max_retries=1, backoff_s=0.01)
    with RewardRunner(remote, timeout_s=remote.max_budget_s() + 5.0, batched=True) as runner:
        rewards, stats = runner.score(["a", "b"], ["a", "b"], extras=[{"dict": True}, {}])
        assert rewards == [0.0, 0.0] and stats == {"num_errors": 2, "num_timeouts": 0}
        rewards, stats = runner.score(["a", "b"], ["a", "x"], extras=[{"dict": True}, {}])  # server back
    assert rewards == [1.0, 0.0] and stats["components"] == {"len": [1.0, 0.0]} and stats["preds"] == ["a", None]


def test_unreachable_server_and_bad_url():
    with pytest.raises(RewardServerError, match="failed after 2 attempts"):
        HttpReward("http://127.0.0.1:9/none", timeout_s=0.5, max_retries=1, backoff_s=0.01)(["a"], ["a"])
    with pytest.raises(ValueError, match="expected http"):
        HttpReward("ftp://x")
