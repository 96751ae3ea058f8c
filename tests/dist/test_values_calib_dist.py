"""Calibrated Clipping on 2 real gloo ranks: the all-reduced histogram is the histogram of the
concatenated tokens on one process (ranks holding 23 and 700 tokens, ratios tied on bin edges, on
the ends of the range and on 1 -/+ eps), so both ranks apply the one-process (L, H) and metrics;
and the calibration decisions are collective with the trigger on ONE rank: a NaN on rank 1 alone
skips the calibration on both ranks, A<0 tokens on rank 0 alone still calibrate both. One launch."""

from __future__ import annotations

import math

import pytest
import torch

from _launch import run_distributed

EPS_LOW, EPS_HIGH, BINS, RANGE = 0.2, 0.28, 64, 2.0
# log r exactly on bin edges (0, -1, 1, -0.5, 0.5), exactly on the ends of the range (-2, 2), and the
# BF16 thresholds themselves; e^k round-trips through log exactly for these k
TIES = [1.0, math.exp(-1.0), math.exp(1.0), math.exp(-0.5), math.exp(0.5), math.exp(-2.0), math.exp(2.0), 0.8, 1.28]


def _shard(rank: int) -> tuple[torch.Tensor, ...]:
    """(r8, r_ref, A, mask, weights) of one rank: rank 0 holds 23 tokens, rank 1 700 (10 masked)."""
    n = (23, 700)[rank]
    g = torch.Generator().manual_seed(100 + rank)
    log16 = torch.randn(n, generator=g, dtype=torch.float64) * 0.2
    log8 = log16 + torch.randn(n, generator=g, dtype=torch.float64) * 0.08 - 0.03
    r8, r16 = log8.exp(), log16.exp()
    k = len(TIES)
    r8[:k] = torch.tensor(TIES, dtype=torch.float64)
    r16[:k] = torch.tensor(TIES[::-1], dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.ones(n)
    mask[-10:] = 0.0 if rank else 1.0
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    return r8[None], r16[None], adv[None], mask[None], weights[None]


def _calibrate(ctrl, shards, reduce):
    hist = ctrl.new_histogram()
    for r8, r16, adv, mask, w in shards:
        hist.add(r8, r16, adv, mask, weights=w)
    metrics = ctrl.update_from_histogram(hist, reduce)
    return hist.payload.clone(), ctrl.bounds, metrics


def _controller():
    from megatron_rl.algo.calib_solve import Rules
    from megatron_rl.algo.calibrated_clip import CalibratedClipController

    rules = Rules(low_min=0.3, high_max=3.0, alpha_tolerance=0.0, alpha_tolerance_tokens=0.0)
    return CalibratedClipController(EPS_LOW, EPS_HIGH, num_bins=BINS, log_ratio_range=RANGE, rules=rules)


def _scenarios(shard_of, reduce) -> dict:
    """What each rank (shard_of(rank) -> its tokens; one process: all ranks' tokens) computes."""
    out = {}
    ctrl = _controller()
    out["first"] = _calibrate(ctrl, shard_of(_shard), reduce)
    second = [tuple(t.flip(-1) for t in s[:2]) + (-s[2],) + s[3:] for s in shard_of(_shard)]
    out["second"] = _calibrate(ctrl, second, reduce)  # out-of-sample scores of the first pair

    def nan_on_rank_1(rank):
        r8, *rest = _shard(rank)
        if rank == 1:
            r8 = r8.clone()
            r8[0, 3] = math.nan
        return (r8, *rest)

    ctrl = _controller()
    out["nan"] = _calibrate(ctrl, shard_of(nan_on_rank_1), reduce)
    out["nan_retry"] = ctrl.should_calibrate(1)

    def negatives_on_rank_0(rank):
        r8, r16, adv, mask, w = _shard(rank)
        return r8, r16, (-adv.abs() if rank == 0 else adv.abs()), mask, w

    out["one_sided"] = _calibrate(_controller(), shard_of(negatives_on_rank_0), reduce)
    return out


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    calls = []

    def reduce(t):
        calls.append(t.numel())
        dist.all_reduce(t)
        return t

    out = _scenarios(lambda make: [make(rank)], reduce)
    out["calls"] = calls
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, timeout_s=180)


@pytest.fixture(scope="module")
def single():
    return _scenarios(lambda make: [make(0), make(1)], None)


def _same_metrics(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in b.items():
        assert a[key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key


@pytest.mark.parametrize("case", ["first", "second", "one_sided"])
def test_the_all_reduced_histogram_is_the_histogram_of_the_concatenated_tokens(ranks, single, case):
    payload, bounds, metrics = single[case]
    for r in ranks:
        assert torch.allclose(r[case][0], payload, rtol=1e-12, atol=1e-12)
        assert r[case][1] == pytest.approx(bounds, rel=1e-12)
        _same_metrics(r[case][2], metrics)
    assert ranks[0][case][1] == ranks[1][case][1]  # bitwise: both ranks clip with one pair
    assert metrics["calib/skipped"] == 0.0 and bounds != (1 - EPS_LOW, 1 + EPS_HIGH)
    assert metrics["calib/tokens"] == 23 + 690  # rank 1's 10 masked tokens are not counted


def test_the_shards_alone_would_give_other_bounds(ranks, single):
    """The test has teeth: rank 1's tokens alone calibrate to another pair than the whole batch."""
    alone = _calibrate(_controller(), [_shard(1)], None)[1]
    assert alone != pytest.approx(single["first"][1], rel=1e-6)


def test_out_of_sample_scores_are_taken_on_the_reduced_histogram(ranks, single):
    oos = {k: v for k, v in single["second"][2].items() if k.startswith("calib/oos_")}
    assert oos and all(ranks[r]["second"][2][k] == pytest.approx(v, rel=1e-9) for r in (0, 1) for k, v in oos.items())


def test_a_nan_on_one_rank_skips_the_calibration_on_both(ranks):
    for r in ranks:
        payload, bounds, metrics = r["nan"]
        assert metrics["calib/skipped"] == 1.0 and metrics["calib/skipped_nonfinite"] == 1.0
        assert metrics["calib/nonfinite"] == 1.0
        assert bounds == (1 - EPS_LOW, 1 + EPS_HIGH) and r["nan_retry"]


def test_negatives_on_one_rank_only_calibrate_both_ranks(ranks):
    for r in ranks:
        assert r["one_sided"][2]["calib/skipped_no_negative"] == 0.0
        assert r["one_sided"][2]["calib/low_solved"] == 1.0


def test_each_calibration_is_one_collective(ranks):
    size = 8 * BINS + 17
    assert ranks[0]["calls"] == ranks[1]["calls"] == [size] * 4
