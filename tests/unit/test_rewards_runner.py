"""RewardRunner: raising, hanging, dying and non-numeric reward functions score 0 and are counted."""

import logging
import os
import time

import pytest

from megatron_rl.rewards import RewardRunner, exact_match
from megatron_rl.rewards import runner as runner_module

_real_worker_main = runner_module._worker_main


def picky(response, answer):
    """Behaves per response: the test's only source of failures."""
    if response == "raise":
        raise KeyError("boom")
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os._exit(3)
    if response == "nan":
        return float("nan")
    if response == "none":
        return None
    return 1.0 if response == answer else 0.25


def test_good_function_scores_in_order():
    with RewardRunner(exact_match, timeout_s=60.0) as runner:
        rewards, stats = runner.score(["1", "2", " 3 "], ["1", "3", "3"])
        assert rewards == [1.0, 0.0, 1.0]
        assert stats == {"num_errors": 0, "num_timeouts": 0}
        assert runner.score([], []) == ([], {"num_errors": 0, "num_timeouts": 0})


def test_raising_function_scores_zero_and_is_counted(caplog):
    responses = ["a", "raise", "b", "nan", "none", "raise"]
    answers = ["a", "x", "c", "x", "x", "x"]
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rewards.runner"):
        with RewardRunner(picky, timeout_s=60.0) as runner:
            rewards, stats = runner.score(responses, answers)
            assert runner.num_restarts == 0  # an exception does not cost the worker
    assert rewards == [1.0, 0.0, 0.25, 0.0, 0.0, 0.0]
    assert stats == {"num_errors": 4, "num_timeouts": 0}
    assert "item 1 scored 0.0: KeyError: 'boom'" in caplog.text
    assert "item 3 scored 0.0: ValueError: non-finite reward nan" in caplog.text
    assert "item 4 scored 0.0: TypeError" in caplog.text


def test_hanging_function_times_out_and_the_rest_is_scored(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rewards.runner"):
        with RewardRunner(picky, timeout_s=3.0) as runner:
            start = time.monotonic()
            rewards, stats = runner.score(["a", "hang", "b", "hang", "c"], ["a", "x", "b", "x", "x"])
            elapsed = time.monotonic() - start
            assert rewards == [1.0, 0.0, 1.0, 0.0, 0.25]
            assert stats == {"num_errors": 0, "num_timeouts": 2}
            assert elapsed < 40.0  # two 3 s timeouts, not two 60 s sleeps
            assert runner.num_restarts == 2
            again, stats = runner.score(["q"], ["q"])  # the restarted worker keeps serving
            assert again == [1.0] and stats == {"num_errors": 0, "num_timeouts": 0}
    assert "item 1 scored 0.0: timed out after 3.0 s" in caplog.text


def _slow_start_worker(*args):
    time.sleep(8.0)  # a fork on a loaded host
    _real_worker_main(*args)


def test_a_slow_worker_start_is_not_a_timeout(monkeypatch):
    """timeout_s bounds the reward function: a worker that takes longer than it to start (a loaded
    CI host) still scores every item."""
    monkeypatch.setattr(runner_module, "_worker_main", _slow_start_worker)
    with RewardRunner(picky, timeout_s=3.0) as r:  # under the start, over a loaded host's stalls
        assert r.score(["a", "b"], ["a", "x"]) == ([1.0, 0.25], {"num_errors": 0, "num_timeouts": 0})


def test_a_worker_that_never_starts_is_named(monkeypatch):
    monkeypatch.setattr(runner_module, "_worker_main", lambda *args: time.sleep(30))
    monkeypatch.setattr(runner_module, "STARTUP_TIMEOUT_S", 0.5)
    with RewardRunner(picky, timeout_s=60.0, name="slowpoke") as r:
        with pytest.raises(RuntimeError, match="reward worker for slowpoke did not start within 0.5 s"):
            r.score(["a"], ["a"])


def test_a_worker_dying_at_start_up_is_named(monkeypatch):
    monkeypatch.setattr(runner_module, "_worker_main", lambda *args: os._exit(7))
    with RewardRunner(picky, timeout_s=60.0, name="doomed") as r:
        with pytest.raises(RuntimeError, match=r"reward worker for doomed exited at start-up \(exit code 7\)"):
            r.score(["a"], ["a"])


def test_dying_worker_is_an_error_and_restarted():
    with RewardRunner(picky, timeout_s=60.0) as runner:
        rewards, stats = runner.score(["a", "die", "b"], ["a", "x", "x"])
        assert rewards == [1.0, 0.0, 0.25]
        assert stats == {"num_errors": 1, "num_timeouts": 0}


def test_closures_run_under_fork():
    offset = 0.5
    with RewardRunner(lambda r, a: float(r == a) + offset, timeout_s=60.0) as runner:
        assert runner.score(["1", "2"], ["1", "1"])[0] == [1.5, 0.5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(exact_match, timeout_s=0)
    with pytest.raises(ValueError, match="mp_context 'threads'"):
        RewardRunner(exact_match, mp_context="threads")
    with RewardRunner(exact_match) as runner, pytest.raises(ValueError, match="2 responses but 1 answers"):
        runner.score(["a", "b"], ["a"])


def test_worker_ends_when_its_parent_is_killed():
    """A rank SIGKILLed mid-run (a dead peer, the OOM killer) must not leave its reward worker
    behind: orphaned, it escapes a scheduler that ends a job by its process tree."""
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from megatron_rl.rewards import RewardRunner, exact_match\n"
        "r = RewardRunner(exact_match, timeout_s=60.0)\n"
        "r.score(['a'], ['a'])\n"
        "print(r.workers[0].proc.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
