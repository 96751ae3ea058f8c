"""Decisions every rank must take alike, on 2 real gloo processes with the trigger on ONE rank:
a stop request (rank 0's view decides, whichever rank sees the file), the metric payload of ranks
that built their metric dicts in different orders, and eval numbers over ranks holding different
numbers of problems and samples (sums, not means of means), and the resumed surge detector (rank
0 holds the log). One launch runs all four."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from _launch import run_distributed


def _stop_decisions(rank: int, tmp: str) -> list:
    from megatron_rl import train
    from megatron_rl.loop import signals

    out = []
    for who in (1, 0, None):  # the rank whose stop file exists
        request = os.path.join(tmp, f"stop_{who}_{rank}")
        if who == rank:
            open(request, "w").close()
        os.environ["MEGATRON_RL_STOP_REQUEST"] = request
        os.environ["MEGATRON_RL_STOP_FILE"] = os.path.join(tmp, f"requeue_{who}")
        saves = []
        run_ = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(num_steps=5)), is_log_rank=rank == 0,
                               save_due=lambda step: True, checkpointer=SimpleNamespace(wait=lambda: saves.append(1)))
        out.append((train._stop_after(run_, 2, None), train._stop_after(run_, 4, None), signals.stop_requested()))
    return out


def _detector_after_resume(rank: int) -> dict:
    """The resumed surge detector: only rank 0's logger holds the steps before the resume."""
    from megatron_rl import train
    from megatron_rl.config import load_config

    history = [{"step": s, "entropy": e} for s, e in enumerate([1.0, 0.8, 1.3, 1.4, 1.5])]
    run_ = SimpleNamespace(cfg=load_config(None), is_log_rank=rank == 0,
                           logger=SimpleNamespace(history=history if rank == 0 else []))
    return train._surge_detector(run_).update(5, {"entropy": 1.6})


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_rl.algo.metrics import metric, reduce_metrics
    from megatron_rl.loop.evaluate import EvalSet, _reduce

    dist.init_process_group("gloo")
    stops = _stop_decisions(rank, tmp)

    def reduce(t):
        dist.all_reduce(t)
        return t

    if rank == 0:
        mine = {"a": metric(1.0, 1.0), "b": metric(10.0, 2.0)}
    else:  # the same keys, inserted in the other order
        mine = {"b": metric(30.0, 2.0), "a": metric(3.0, 3.0)}
    metrics = reduce_metrics([mine], reduce)

    run = SimpleNamespace(parallel=SimpleNamespace(dp_reducer=lambda: reduce, dp_group=None))
    s = EvalSet(SimpleNamespace(name="h"), [], "r", None, None, ["avg@1", "maj@1"])
    if rank == 0:  # one problem of 2 samples, with extracted answers
        rows = [{"rewards": [1.0, 1.0], "preds": ["x", "x"], "lengths": [2, 2], "truncated": [True, False],
                 "garbled": None}]
    else:  # two problems of 2 samples each, no answer extracted
        rows = [{"rewards": [0.0, 0.0], "preds": [None] * 2, "lengths": [8, 8], "truncated": [False, False],
                 "garbled": None}] * 2
    evals = _reduce(run, s, rows, [rank, 0])
    return {"stops": stops, "metrics": metrics, "eval": evals, "health": _detector_after_resume(rank)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("collective")
    return run_distributed(_worker, 2, args=(str(tmp),), timeout_s=180), tmp


def test_rank_zeros_stop_request_stops_both_ranks_and_rank_ones_alone_stops_none(results):
    ranks, tmp = results
    # per trigger (rank 1, rank 0, nobody): (stop after step 2, after the last step 4, own view)
    assert ranks[0]["stops"] == [(False, False, False), (True, False, True), (False, False, False)]
    assert ranks[1]["stops"] == [(False, False, True), (True, False, False), (False, False, False)]
    assert (tmp / "requeue_0").read_text() == "3\n"  # rank 0 names the step to resume from
    assert not (tmp / "requeue_1").exists()


def test_metrics_built_in_different_orders_sum_key_by_key(results):
    ranks, _ = results
    assert ranks[0]["metrics"] == ranks[1]["metrics"] == {"a": 1.0, "b": 10.0}  # 4/4, 40/4


def test_eval_numbers_are_sums_over_the_ranks_problems_and_samples(results):
    ranks, _ = results
    for r in ranks:
        e = r["eval"]
        assert e["avg@1"] == pytest.approx(1 / 3)  # 3 problems: 1, 0, 0 (not the mean of 1 and 0)
        assert e["maj@1"] == pytest.approx(1 / 3)  # on both ranks: rank 0's answers decide that it is logged
        assert e["response_length/mean"] == pytest.approx((2 + 2 + 8 * 4) / 6)
        assert e["response_length/max"] == 8.0
        assert e["truncated_rate"] == pytest.approx(1 / 6)
        assert e["reward_errors"] == 1.0  # rank 1's one error, counted once on both ranks


def test_a_resumed_surge_detector_carries_rank_zeros_history_to_every_rank(results):
    """entropy 1.0, 0.8, 1.3, 1.4, 1.5 logged before the resume, then 1.6: minimum 0.8, rise
    1.6 / 0.8 - 1 = 1.0, and steps 2-5 each rose >= 0.5 over the minimum: a streak of 4 (patience 10:
    no surge yet). Rank 1 logged nothing itself and must agree."""
    ranks, _ = results
    expected = {"health/entropy_min": 0.8, "health/entropy_rise": 1.0, "health/rise_streak": 4.0, "health/surge": 0.0}
    for r in ranks:
        assert r["health"] == pytest.approx(expected)
