"""Calibrated Clipping: histogram bounds against an exact sort-based reference, guard rails, controller."""

import math

import pytest
import torch

from megatron_rl.algo.calibrated_clip import CalibratedClipController, calibrate_bounds
from megatron_rl.algo.ratio_histogram import RatioHistogram


def _data(seed, n=40000, noise=0.06, bias=-0.02):
    """BF16 log-ratios ~ N(0, 0.15); FP8 = BF16 + biased noise; per-token advantages; 10% masked."""
    g = torch.Generator().manual_seed(seed)
    log16 = torch.randn(n, generator=g) * 0.15
    log8 = log16 + torch.randn(n, generator=g) * noise + bias
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.1).float()
    return log8.exp().reshape(80, -1), log16.exp().reshape(80, -1), adv.reshape(80, -1), mask.reshape(80, -1)


def _exact_reference(r8, r16, adv, mask, eps_low, eps_high, low):
    """Sort-based: the interval of exact alpha-quantiles of r8 | A<0, p16, and the exact H given `low`."""
    v = mask.bool()
    r8, r16, adv = r8[v].double(), r16[v].double(), adv[v].double()
    neg, pos = adv < 0, adv > 0
    m = int((r16[neg] < 1 - eps_low).sum())
    s = r8[neg].sort().values
    # any L in (s[m-1], s[m]] lower-clips exactly m tokens (ties have probability 0 here)
    quantile_interval = (s[m - 1].item(), s[m].item())
    weight16, weight8 = adv.abs() * r16, adv.abs() * r8
    p16 = (weight16[pos & (r16 <= 1 + eps_high)].sum() / weight16[neg & (r16 >= 1 - eps_low)].sum()).item()
    target = p16 * weight8[neg & (r8 >= low)].sum().item()
    order = r8[pos].argsort()
    cum = weight8[pos][order].cumsum(0)
    j = int((cum < target).sum())
    high_exact = r8[pos][order][j].item() if j < len(order) else math.inf
    return quantile_interval, high_exact, p16


def _balance(r8, adv, mask, low, high):
    v = mask.bool()
    r8, adv = r8[v].double(), adv[v].double()
    w = adv.abs() * r8
    return (w[(adv > 0) & (r8 <= high)].sum() / w[(adv < 0) & (r8 >= low)].sum()).item()


@pytest.mark.parametrize("num_bins", [256, 2048])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bounds_match_sort_based_reference_within_one_bin(seed, num_bins):
    r8, r16, adv, mask = _data(seed)
    low, high = calibrate_bounds(r8, r16, adv, mask, 0.2, 0.28, num_bins=num_bins)
    width = 4.0 / num_bins  # default log_ratio_range 2 -> [-2, 2]
    (q_lo, q_hi), high_exact, p16 = _exact_reference(r8, r16, adv, mask, 0.2, 0.28, low)
    assert math.log(q_lo) - width <= math.log(low) <= math.log(q_hi) + width
    assert abs(math.log(high) - math.log(high_exact)) <= width
    assert _balance(r8, adv, mask, low, high) == pytest.approx(p16, rel=2e-3)
    # the FP8 run now lower-clips the fraction of A<0 tokens BF16 clips (paper claim 5)
    v, neg = mask.bool(), adv < 0
    alpha16 = ((r16 < 0.8) & neg & v).sum() / (neg & v).sum()
    alpha8 = ((r8 < low) & neg & v).sum() / (neg & v).sum()
    assert alpha8.item() == pytest.approx(alpha16.item(), abs=2e-3)
    # uncalibrated FP8 (noise biased downwards) over-clips A<0 tokens: the failure being corrected
    assert ((r8 < 0.8) & neg & v).sum() > ((r16 < 0.8) & neg & v).sum()


@pytest.mark.parametrize("eps_high", [0.2, 0.28])
def test_identical_ratios_give_the_uncalibrated_bounds_within_a_bin(eps_high):
    _, r16, adv, mask = _data(3)
    low, high = calibrate_bounds(r16, r16.clone(), adv, mask, 0.2, eps_high, num_bins=1024)
    width = 4.0 / 1024
    assert abs(math.log(low) - math.log(0.8)) <= width
    assert abs(math.log(high) - math.log(1.0 + eps_high)) <= width


def test_small_case_by_hand():
    # A<0: r16 = 0.5, 0.7, 0.9, 1.0 -> alpha = 2/4; r8 = 0.6, 0.65, 0.75, 0.95 -> any L in
    # (0.65, 0.75] clips exactly two; the one closest to 1 - eps = 0.8 is 0.75 (its bin's lower edge)
    # p16 = (1.0 + 1.1) / (0.9 + 1.0); neg8(L) = 0.75 + 0.95; target = 1.8789...
    # A>0 r8 = 0.9, 1.05, 1.4: cumulative |A| r8 = 0.9, 1.95, 3.35 -> H = 1.05 (within its bin)
    r16 = torch.tensor([[0.5, 0.7, 0.9, 1.0, 1.0, 1.1, 1.5]])
    r8 = torch.tensor([[0.6, 0.65, 0.75, 0.95, 0.9, 1.05, 1.4]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0]])
    low, high = calibrate_bounds(r8, r16, adv, torch.ones_like(adv), 0.2, 0.2, num_bins=4000)
    width = 4.0 / 4000
    assert 0.75 * math.exp(-width) <= low <= 0.75
    assert 1.05 * math.exp(-width) <= high <= 1.05 * math.exp(width)


def test_bounds_stay_at_bf16_values_when_the_quantile_interval_contains_them():
    # BF16 clips no A<0 token and no FP8 ratio is below 0.8: L stays 0.8 (any L <= 0.85 is exact).
    # FP8 swaps the two A<0 ratios (same kept mass, bit for bit); A>0 ratios agree and are all
    # below 1.2, so the balance needs all of the A>0 mass: any H >= 1.1 is exact and H stays 1.2.
    r16 = torch.tensor([[0.85, 1.0, 1.1, 0.9, 1.1]])
    r8 = torch.tensor([[1.0, 0.85, 1.1, 0.9, 1.1]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0, 1.0]])
    low, high = calibrate_bounds(r8, r16, adv, torch.ones_like(adv), 0.2, 0.2, num_bins=4000)
    assert low == pytest.approx(0.8, rel=1e-12) and high == pytest.approx(1.2, rel=1e-12)
    # the FP8 minimum below 0.8: L must sit at or under it so that still nothing is clipped
    r8[0, 0] = 0.7
    low, _ = calibrate_bounds(r8, r16, adv, torch.ones_like(adv), 0.2, 0.2, num_bins=4000)
    assert 0.7 * math.exp(-4.0 / 4000) <= low <= 0.7


def test_unattainable_balance_means_no_upper_clip():
    _, r16, adv, mask = _data(4)
    r8 = torch.where(adv > 0, r16 * 0.5, r16)  # FP8 positive mass far below what BF16 keeps
    ctrl = CalibratedClipController(0.2, 0.2)
    metrics = ctrl.update(r8, r16, adv, mask)
    assert ctrl.bounds[1] == math.inf and metrics["calib/high_unbounded"] == 1.0
    assert calibrate_bounds(r8, r16, adv, mask, 0.2, 0.2)[1] == math.inf


def test_micro_batch_accumulation_equals_one_add_and_reduces_once():
    r8, r16, adv, mask = _data(5)
    whole = RatioHistogram(0.2, 0.28)
    whole.add(r8, r16, adv, mask)
    parts = RatioHistogram(0.2, 0.28)
    for rows in (slice(0, 10), slice(10, 55), slice(55, 80)):
        parts.add(r8[rows], r16[rows], adv[rows], mask[rows])
    calls = []
    parts.reduce(lambda t: calls.append(t.numel()) or t)
    assert calls == [parts.payload.numel()]
    assert torch.allclose(whole.payload, parts.payload, rtol=1e-12, atol=0)
    assert torch.equal(whole.histogram("neg_count"), parts.histogram("neg_count"))
    with pytest.raises(RuntimeError):
        parts.reduce()


def test_payload_size_does_not_grow_with_tokens():
    small, large = RatioHistogram(num_bins=512), RatioHistogram(num_bins=512)
    small.add(torch.ones(1, 4), torch.ones(1, 4), -torch.ones(1, 4), torch.ones(1, 4))
    large.add(*[t.expand(200, 1000) for t in (torch.ones(1, 1), torch.ones(1, 1), -torch.ones(1, 1), torch.ones(1, 1))])
    assert small.payload_bytes() == large.payload_bytes() == (3 * 512 + 12) * 8


def test_out_of_range_ratios_are_clamped_and_counted():
    r = torch.tensor([[1e-6, 0.0, 1.0, 50.0]])
    hist = RatioHistogram(num_bins=64)
    hist.add(r, r, torch.tensor([[-1.0, -1.0, -1.0, 1.0]]), torch.ones(1, 4))
    assert hist.scalar("out_of_range") == 3.0
    assert hist.histogram("neg_count")[0] == 2.0 and hist.histogram("pos_weight")[-1] == 50.0


def _controller_after_one_update(**kwargs):
    ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28, **kwargs)
    r8, r16, adv, mask = _data(6)
    return ctrl, ctrl.update(r8, r16, adv, mask), calibrate_bounds(r8, r16, adv, mask, 0.2, 0.28)


@pytest.mark.parametrize("case", ["empty", "nonfinite", "no_negative"])
def test_guard_rails_keep_previous_bounds_and_count(case):
    ctrl, _, raw = _controller_after_one_update()
    r8, r16, adv, mask = _data(7)
    if case == "empty":
        mask = torch.zeros_like(mask)
    elif case == "nonfinite":
        r8[3, 5], mask[3, 5] = float("nan"), 1.0
    else:
        adv = adv.abs()
    metrics = ctrl.update(r8, r16, adv, mask)
    assert ctrl.bounds == raw
    assert metrics["calib/skipped"] == 1.0 and metrics[f"calib/skipped_{case}"] == 1.0
    assert metrics["calib/num_skipped"] == 1.0 and metrics["calib/num_calibrations"] == 1.0
    assert calibrate_bounds(r8, r16, adv, mask, 0.2, 0.28) == (0.8, 1.28)  # stateless: uncalibrated


def test_nan_on_a_masked_position_is_ignored():
    r8, r16, adv, mask = _data(8)
    clean = calibrate_bounds(r8, r16, adv, mask, 0.2, 0.28)
    mask[0, 0] = 0.0
    r8[0, 0] = float("nan")
    r8_ref = r8.clone()
    r8_ref[0, 0] = 1.0
    assert calibrate_bounds(r8, r16, adv, mask, 0.2, 0.28) == calibrate_bounds(r8_ref, r16, adv, mask, 0.2, 0.28)
    assert all(math.isfinite(b) for b in clean)


def test_no_positive_tokens_updates_low_only():
    ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28, init_high=1.5)
    r8, r16, adv, mask = _data(9)
    metrics = ctrl.update(r8, r16, -adv.abs(), mask)
    assert ctrl.bounds[1] == 1.5 and ctrl.bounds[0] != 0.8
    assert metrics["calib/high_kept"] == 1.0 and metrics["calib/skipped"] == 0.0


def test_smoothing_period_and_state_dict():
    ctrl, metrics, (raw_low, raw_high) = _controller_after_one_update(init_low=0.6, init_high=1.8, smoothing=0.25, period=20)
    assert metrics["calib/low_raw"] == pytest.approx(raw_low) and metrics["calib/high_raw"] == pytest.approx(raw_high)
    assert ctrl.bounds == pytest.approx((0.75 * 0.6 + 0.25 * raw_low, 0.75 * 1.8 + 0.25 * raw_high))
    assert [s for s in range(61) if ctrl.should_calibrate(s)] == [0, 20, 40, 60]
    fresh = CalibratedClipController(eps_low=0.2, eps_high=0.28)
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.bounds == ctrl.bounds and fresh.state_dict() == ctrl.state_dict()
    with pytest.raises(ValueError, match="high"):
        fresh.load_state_dict({"low": 0.7, "num_calibrations": 1, "num_skipped": 0})


def test_lower_only_mode_keeps_high_at_one_plus_eps_high():
    ctrl, metrics, (raw_low, _) = _controller_after_one_update(mode="lower_only", init_high=1.8)
    assert ctrl.bounds == (pytest.approx(raw_low), 1.28)
    assert math.isnan(metrics["calib/high_raw"])


def test_default_bounds_before_any_calibration_and_bad_knobs():
    assert CalibratedClipController(eps_low=0.2, eps_high=0.28).bounds == (0.8, 1.28)
    for kwargs, match in [({"period": 0}, "period"), ({"smoothing": 0.0}, "smoothing"), ({"mode": "upper"}, "mode"),
                          ({"num_bins": 1}, "num_bins"), ({"init_low": 1.5, "init_high": 1.2}, "init_low")]:
        with pytest.raises(ValueError, match=match):
            CalibratedClipController(**kwargs)
    ctrl = CalibratedClipController(num_bins=128)
    with pytest.raises(ValueError, match="num_bins"):
        ctrl.update_from_histogram(RatioHistogram(num_bins=256))
