"""The reward worker's side, driven in this process: what it sends back for each batch, per-sample and
batched, and how a result is normalized. (test_rewards_runner.py drives the same code through a
real worker process; this file sees it from the inside, item by item.)"""

import logging
import multiprocessing as mp
import time

import pytest

from megatron_rl.rewards.runner import (MAX_LOGGED_FAILURES, RewardRunner, _assemble, _call_batched,
                                        _worker_main, normalize)


def scored(response, answer, bonus=0.0):
    if response == "raise":
        raise KeyError("boom")
    if response == "dict":
        return {"score": 2, "format": 1, "len": 3.5, "pred": 41, "note": "text", "flag": True}
    if response == "inf":
        return float("-inf")
    return float(response == answer) + bonus


def test_normalize_numbers_and_dicts():
    assert normalize(3) == (3.0, {}, None)
    assert normalize(0.25) == (0.25, {}, None)
    # numeric components only (a bool is an int); pred as a string; "score" and "pred" are not components
    assert normalize({"score": 2, "format": 1, "len": 3.5, "pred": 41, "note": "text", "flag": True}) == (
        2.0, {"format": 1.0, "len": 3.5, "flag": 1.0}, "41")
    assert normalize({"score": 1.0, "pred": None}) == (1.0, {}, None)
    assert normalize({"score": 1.0, "components": "x"}) == (1.0, {}, None)


@pytest.mark.parametrize("value, message", [
    ({"correct": 1.0, "format": 0.0}, r"reward dict without 'score': keys \['correct', 'format'\]"),
    (float("nan"), "non-finite reward nan"),
    (float("inf"), "non-finite reward inf"),
    ({"score": 1.0, "format": float("-inf")}, "non-finite reward -inf"),
    ({"score": float("nan")}, "non-finite reward nan"),
])
def test_normalize_refuses_what_cannot_be_a_reward(value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        normalize(value)
    with pytest.raises(TypeError):
        normalize(None)


def _serve(fn, batches, batched=False):
    """Every reply `_worker_main` sends for `batches` (then None), read back in order."""
    worker_end, our_end = mp.Pipe()
    for batch in batches:
        our_end.send(batch)
    our_end.send(None)
    _worker_main(fn, worker_end, batched)
    replies = []
    while our_end.poll(0):
        replies.append(our_end.recv())
    assert replies[0] == (-1, "ready", None)  # first, before any batch is read
    return replies[1:]


def test_the_worker_replies_per_item_in_order_and_keeps_going_after_an_error():
    batches = [[(4, "a", "a", {}), (7, "raise", "a", {}), (9, "b", "a", {"bonus": 0.5})],
               [(2, "dict", "x", {}), (3, "inf", "x", {})]]
    assert _serve(scored, batches) == [
        (4, "ok", (1.0, {}, None)),
        (7, "error", "KeyError: 'boom'"),
        (9, "ok", (0.5, {}, None)),
        (2, "ok", (2.0, {"format": 1.0, "len": 3.5, "flag": 1.0}, "41")),
        (3, "error", "ValueError: non-finite reward -inf"),
    ]


def test_the_worker_stops_at_none_and_at_a_closed_pipe():
    assert _serve(scored, []) == []
    worker_end, our_end = mp.Pipe()
    our_end.close()
    _worker_main(scored, worker_end, False)  # EOF: returns instead of raising
    # a forked worker closes the parent's end it inherited
    worker_end, our_end = mp.Pipe()
    our_end.send(None)
    _worker_main(scored, worker_end, False, parent_end=our_end)
    assert our_end.closed


def batched_fn(responses, answers, level=None, weight=None):
    if "raise" in responses:
        raise RuntimeError("grader down")
    if "short" in responses:
        return [1.0]
    if "scalar" in responses:
        return 1.0
    return [{"score": float(r == a), "lvl": float(lv == "hard"), "w": 0.0 if w is None else w}
            if r != "nan" else float("nan") for r, a, lv, w in zip(responses, answers, level, weight)]


def test_a_batched_worker_replies_once_per_batch_with_every_items_result():
    batch = [(5, "a", "a", {"level": "hard"}), (6, "b", "a", {"weight": 2.0}), (8, "nan", "a", {})]
    assert _serve(batched_fn, [batch, []], batched=True) == [
        (5, "ok", [("ok", (1.0, {"lvl": 1.0, "w": 0.0}, None)),
                   ("ok", (0.0, {"lvl": 0.0, "w": 2.0}, None)),
                   ("error", "ValueError: non-finite reward nan")]),
        (-1, "ok", []),  # an empty batch is answered too, with no item to name
    ]


def test_batched_calls_get_one_list_per_extra_column_with_none_where_a_row_lacks_it():
    seen = {}

    def spy(responses, answers, **columns):
        seen.update(responses=responses, answers=answers, **columns)
        return [0.0] * len(responses)

    _call_batched(spy, [(0, "r0", "a0", {"b": 1}), (1, "r1", "a1", {"a": 2, "b": 3}), (2, "r2", "a2", {})])
    assert seen == {"responses": ["r0", "r1", "r2"], "answers": ["a0", "a1", "a2"],
                    "a": [None, 2, None], "b": [1, 3, None]}


@pytest.mark.parametrize("response, reason", [
    ("raise", "RuntimeError: grader down"),
    ("short", "ValueError: batched reward returned list of length 1 for 2 samples"),
    ("scalar", "ValueError: batched reward returned float of length ? for 2 samples"),
])
def test_a_batched_failure_fails_every_item_with_the_reason(response, reason):
    batch = [(0, response, "a", {}), (1, "b", "b", {})]
    assert _call_batched(batched_fn, batch) == [("error", reason), ("error", reason)]


def test_assemble_fills_failed_items():
    ok = (1.0, {"fmt": 0.5}, "7")
    plain = (0.25, {}, None)
    rewards, stats = _assemble([ok, None, plain], {"num_errors": 1, "num_timeouts": 0})
    assert rewards == [1.0, 0.0, 0.25]
    assert stats == {"num_errors": 1, "num_timeouts": 0, "components": {"fmt": [0.5, 0.0, 0.0]},
                     "preds": ["7", None, None]}
    assert _assemble([plain, None], {"n": 0}) == ([0.25, 0.0], {"n": 0})
    assert _assemble([], {}) == ([], {})


def test_the_runner_keeps_its_settings():
    runner = RewardRunner(scored)
    assert (runner.timeout_s, runner.batched, runner.name, runner.num_restarts) == (10.0, False, "scored", 0)
    assert runner._ctx.get_start_method() == "fork" and runner._extras == frozenset({"bonus"})
    named = RewardRunner(lambda r, a: 0.0, timeout_s=0.5, mp_context="spawn", name="mine", batched=True)
    assert (named.timeout_s, named.batched, named.name) == (0.5, True, "mine")
    assert named._ctx.get_start_method() == "spawn"
    assert RewardRunner(lambda r, a: 0.0).name == "<lambda>"
    with pytest.raises(ValueError, match=r"^timeout_s must be > 0, got -1$"):
        RewardRunner(scored, timeout_s=-1)
    with pytest.raises(ValueError, match=r"^mp_context 'threads' not available; choose from \["):
        RewardRunner(scored, mp_context="threads")


def test_only_the_extras_the_function_names_reach_it():
    with RewardRunner(scored, timeout_s=60.0) as runner:
        rewards, stats = runner.score(["a", "a"], ["a", "b"], extras=[{"bonus": 1.0, "other": 9}, {"bonus": 0.5}])
        assert rewards == [2.0, 0.5] and stats == {"num_errors": 0, "num_timeouts": 0}
        with pytest.raises(ValueError, match=r"^2 responses but 2 answers and 1 extras$"):
            runner.score(["a", "b"], ["a", "b"], extras=[{}])


def test_the_worker_persists_and_a_dead_one_is_replaced_once(caplog):
    with RewardRunner(scored, timeout_s=60.0) as runner:
        runner.score(["a"], ["a"])
        first = runner.workers[0].proc
        runner.score(["b"], ["b"])
        assert runner.workers[0].proc is first and runner.num_restarts == 0  # one worker across calls
        first.kill()
        first.join()
        assert runner.score(["c"], ["c"])[0] == [1.0]
        assert runner.workers[0].proc is not first and runner.workers[0].proc.is_alive() and runner.num_restarts == 1
    assert runner.workers[0].proc is None and runner.workers[0].conn is None


def test_only_the_first_failures_are_logged_but_all_are_counted(caplog):
    responses = ["raise"] * (MAX_LOGGED_FAILURES + 3)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rewards.runner"):
        with RewardRunner(scored, timeout_s=60.0) as runner:
            rewards, stats = runner.score(responses, ["a"] * len(responses))
    assert rewards == [0.0] * len(responses) and stats["num_errors"] == MAX_LOGGED_FAILURES + 3
    assert MAX_LOGGED_FAILURES == 5
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [f"reward fn scored on item {i} scored 0.0: KeyError: 'boom'" for i in range(5)]


def test_a_batched_timeout_scores_every_item_zero_and_restarts_the_worker():
    import time

    def slow(responses, answers):
        time.sleep(30)

    with RewardRunner(slow, timeout_s=0.3, batched=True) as runner:
        rewards, stats = runner.score(["a", "b", "c"], ["a", "b", "c"])
        assert rewards == [0.0, 0.0, 0.0] and stats == {"num_errors": 0, "num_timeouts": 3}
        assert runner.num_restarts == 1 and runner.workers[0].proc is None


def test_non_numbers_in_a_reward_dict_are_not_components():
    assert normalize({"score": 1, "note": None, "tags": ["a"], "detail": {"x": 1}, "n": 2}) == (1.0, {"n": 2.0}, None)


def test_a_callable_without_a_name_is_named_by_its_repr():
    import functools

    fn = functools.partial(scored, bonus=1.0)
    assert RewardRunner(fn).name == repr(fn)


def test_a_function_taking_any_keyword_gets_every_extra_column():
    def everything(response, answer, **extra):
        return float(sum(extra.values()))

    with RewardRunner(everything, timeout_s=60.0) as runner:
        assert runner.score(["a"], ["a"], extras=[{"x": 1.0, "y": 2.0}])[0] == [3.0]
        with pytest.raises(ValueError, match=r"^2 responses but 1 answers$"):
            runner.score(["a", "b"], ["a"])


def _batched(responses, answers):
    """One item per kind of answer: a number, something that is no reward, a dict with a pred."""
    return [1.0, "not a reward", {"score": 2.0, "pred": "x"}][: len(responses)]


def test_a_batched_item_that_is_no_reward_scores_zero_alone(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rewards.runner"):
        with RewardRunner(_batched, timeout_s=60.0, batched=True) as runner:
            rewards, stats = runner.score(["a", "b", "c"], ["a", "b", "c"])
    assert rewards == [1.0, 0.0, 2.0]
    assert stats == {"num_errors": 1, "num_timeouts": 0, "preds": [None, None, "x"]}
    assert [r.getMessage() for r in caplog.records] == [
        "reward fn _batched on item 1 scored 0.0: ValueError: could not convert string to float: 'not a reward'"]


def _exit_on_die(responses, answers):
    import os

    if "die" in responses:
        os._exit(7)
    return [1.0] * len(responses)


@pytest.mark.parametrize("batched", [False, True])
def test_a_worker_that_dies_is_an_error_and_each_death_is_a_restart(caplog, batched):
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rewards.runner"):
        fn = _exit_on_die if batched else (lambda r, a: _exit_on_die([r], [a])[0])
        with RewardRunner(fn, timeout_s=60.0, batched=batched) as runner:
            for call in (1, 2):
                rewards, stats = runner.score(["die", "b"], ["a", "b"])
                # batched: the death fails the whole batch; per sample: the dead item, then a new worker
                assert rewards == ([0.0, 0.0] if batched else [0.0, 1.0])
                assert stats == {"num_errors": 2 if batched else 1, "num_timeouts": 0}
                assert runner.num_restarts == call
            assert runner.score(["b"], ["b"])[0] == [1.0]
    assert caplog.records[0].getMessage().endswith(" on item 0 scored 0.0: reward worker process died")


def test_a_batched_timeout_logs_only_the_first_failures():
    import time

    def slow(responses, answers):
        time.sleep(30)

    logger = logging.getLogger("megatron_rl.rewards.runner")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        with RewardRunner(slow, timeout_s=0.3, batched=True) as runner:
            rewards, stats = runner.score(["a"] * 7, ["a"] * 7)
    finally:
        logger.removeHandler(handler)
    assert stats["num_timeouts"] == 7 and len(seen) == MAX_LOGGED_FAILURES


def test_close_stops_the_worker_politely():
    with RewardRunner(scored, timeout_s=60.0) as runner:
        runner.score(["a"], ["a"])
        worker = runner.workers[0].proc
    assert worker.exitcode == 0  # it read the stop message and returned; not killed


def test_close_does_not_wait_for_a_busy_worker():
    """close() asks the worker to stop, and kills it when it does not within 1 s (a function still
    running after an interrupted score())."""
    runner = RewardRunner(lambda r, a: time.sleep(120), timeout_s=60.0)
    runner.workers[0].start().send([(0, "x", "x", {})])
    worker = runner.workers[0].proc
    start = time.monotonic()
    runner.close()
    assert time.monotonic() - start < 60  # not the function's 120 s
    assert not worker.is_alive()


def test_a_script_that_never_closes_its_runner_still_exits():
    """The worker is a daemon: the interpreter's exit ends it instead of waiting for it forever."""
    import subprocess
    import sys

    script = ("from megatron_rl.rewards.runner import RewardRunner\n"
              "runner = RewardRunner(lambda r, a: 1.0)\n"
              "print(runner.score(['a'], ['a'])[0])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "[1.0]"


def test_a_worker_found_dead_between_calls_is_replaced_each_time():
    with RewardRunner(scored, timeout_s=60.0) as runner:
        for deaths in (1, 2):
            runner.score(["a"], ["a"])
            runner.workers[0].proc.kill()
            runner.workers[0].proc.join()
            assert runner.score(["b"], ["b"])[0] == [1.0] and runner.num_restarts == deaths
