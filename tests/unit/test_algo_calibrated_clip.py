"""Calibrated Clipping: histogram bounds against an exact sort-based reference, guard rails, controller."""

import math

import pytest
import torch

from megatron_rl.algo.calib_solve import Rules
from megatron_rl.algo.calibrated_clip import CalibratedClipController, calibrate_bounds
from megatron_rl.algo.ratio_histogram import RatioHistogram

# The bare rule (no tolerance, wide range, the |A| r balance): checked against exact references.
EXACT = Rules(low_min=0.05, high_max=50.0, alpha_tolerance=0.0, alpha_tolerance_tokens=0.0, balance="abs_adv_ratio")


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
    low, high = calibrate_bounds(r8, r16, adv, mask, 0.2, 0.28, num_bins=num_bins, rules=EXACT)
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
    low, high = calibrate_bounds(r16, r16.clone(), adv, mask, 0.2, eps_high, num_bins=1024, rules=EXACT)
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
    low, high = calibrate_bounds(r8, r16, adv, torch.ones_like(adv), 0.2, 0.2, num_bins=4000, rules=EXACT)
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
    low, high = calibrate_bounds(r8, r16, adv, torch.ones_like(adv), 0.2, 0.2, num_bins=4000, rules=EXACT)
    assert low == pytest.approx(0.8, rel=1e-12) and high == pytest.approx(1.2, rel=1e-12)
    # the FP8 minimum below 0.8: L must sit at or under it so that still nothing is clipped
    r8[0, 0] = 0.7
    low, _ = calibrate_bounds(r8, r16, adv, torch.ones_like(adv), 0.2, 0.2, num_bins=4000, rules=EXACT)
    assert 0.7 * math.exp(-4.0 / 4000) <= low <= 0.7


def test_unattainable_balance_keeps_the_previous_high_never_inf():
    _, r16, adv, mask = _data(4)
    r8 = torch.where(adv > 0, r16 * 0.5, r16)  # FP8 positive mass far below what BF16 keeps
    ctrl = CalibratedClipController(0.2, 0.2, init_high=1.8, rules=EXACT)
    metrics = ctrl.update(r8, r16, adv, mask)
    assert ctrl.bounds[1] == 1.8 and metrics["calib/high_unattainable"] == 1.0
    assert math.isnan(metrics["calib/high_raw"]) and metrics["calib/skipped"] == 0.0
    assert calibrate_bounds(r8, r16, adv, mask, 0.2, 0.2, rules=EXACT)[1] == 1.2


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
    assert small.payload_bytes() == large.payload_bytes() == (8 * 512 + 17) * 8


def test_out_of_range_ratios_are_clamped_and_counted():
    r = torch.tensor([[1e-6, 0.0, 1.0, 50.0]])
    hist = RatioHistogram(num_bins=64)
    hist.add(r, r, torch.tensor([[-1.0, -1.0, -1.0, 1.0]]), torch.ones(1, 4))
    assert hist.scalar("below_range") == 2.0 and hist.scalar("above_range") == 1.0
    assert hist.histogram("neg_count")[0] == 2.0 and hist.histogram("pos_abs_adv_ratio")[-1] == 50.0


def _controller_after_one_update(**kwargs):
    ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28, rules=EXACT, **kwargs)
    r8, r16, adv, mask = _data(6)
    return ctrl, ctrl.update(r8, r16, adv, mask), calibrate_bounds(r8, r16, adv, mask, 0.2, 0.28, rules=EXACT)


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
    ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28, init_high=1.5, rules=EXACT)
    r8, r16, adv, mask = _data(9)
    metrics = ctrl.update(r8, r16, -adv.abs(), mask)
    assert ctrl.bounds[1] == 1.5 and ctrl.bounds[0] != 0.8
    assert metrics["calib/high_undefined"] == 1.0 and metrics["calib/skipped"] == 0.0


def test_smoothing_moves_the_pair_along_the_balance_period_and_state_dict():
    ctrl, metrics, (raw_low, _) = _controller_after_one_update(init_low=0.6, init_high=1.8, smoothing=0.25, period=20)
    low = 0.75 * 0.6 + 0.25 * raw_low
    assert metrics["calib/low_raw"] == pytest.approx(raw_low) and ctrl.bounds[0] == pytest.approx(low)
    # H is the balance solution at the smoothed L: the applied pair balances like BF16
    r8, r16, adv, mask = _data(6)
    _, high_exact, p16 = _exact_reference(r8, r16, adv, mask, 0.2, 0.28, low)
    assert abs(math.log(ctrl.bounds[1]) - math.log(high_exact)) <= 4.0 / 2048
    assert _balance(r8, adv, mask, *ctrl.bounds) == pytest.approx(p16, rel=2e-3)
    assert abs(metrics["calib/is_balance_err"]) < 2e-3
    fresh = CalibratedClipController(eps_low=0.2, eps_high=0.28, rules=EXACT)
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


def test_calibrates_on_the_period_grid_and_retries_a_failed_one_next_step():
    ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28, period=5)
    r8, r16, adv, mask = _data(10)
    calibrated = []
    for step in range(16):
        if ctrl.should_calibrate(step):
            failing = step in (5, 6)  # no A < 0 tokens: skipped, so retried on the next step
            metrics = ctrl.update(r8, r16, adv.abs() if failing else adv, mask, step=step)
            calibrated.append((step, metrics["calib/skipped"]))
    assert calibrated == [(0, 0.0), (5, 1.0), (6, 1.0), (7, 0.0), (10, 0.0), (15, 0.0)]
    restored = CalibratedClipController(eps_low=0.2, eps_high=0.28, period=5)
    restored.load_state_dict(ctrl.state_dict())
    assert not restored.should_calibrate(19) and restored.should_calibrate(20)


def _outlier_batch(n_neg=44410, n_pos=40000, outliers=1, outlier_ratio=0.3, seed=11):
    """BF16 lower-clips nothing (r16 in [0.85, 1.15]); FP8 equals BF16 except `outliers` A<0 tokens at 0.3."""
    g = torch.Generator().manual_seed(seed)
    r16 = 0.85 + 0.3 * torch.rand(1, n_neg + n_pos, generator=g)
    r8 = r16.clone()
    r8[0, :outliers] = outlier_ratio
    adv = torch.cat([-torch.ones(n_neg), torch.ones(n_pos)])[None]
    return r8, r16, adv, torch.ones_like(adv)


def test_one_outlier_token_cannot_move_low():
    r8, r16, adv, mask = _outlier_batch()
    # the bare rule: alpha = 0, so every L <= min r8 = 0.3 is exact and the closest to 0.8 is 0.3
    assert calibrate_bounds(r8, r16, adv, mask, 0.2, 0.2, rules=EXACT)[0] == pytest.approx(0.3, rel=3e-3)
    assert calibrate_bounds(r8, r16, adv, mask, 0.2, 0.2)[0] == 0.8  # default: a 2-token tolerance
    # the tolerance as a fraction: 20 outliers are 0.045% of the A<0 tokens
    r8, r16, adv, mask = _outlier_batch(outliers=20)
    frac = EXACT._replace(alpha_tolerance=0.001)
    assert calibrate_bounds(r8, r16, adv, mask, 0.2, 0.2, rules=frac)[0] == 0.8
    assert calibrate_bounds(r8, r16, adv, mask, 0.2, 0.2, rules=EXACT._replace(alpha_tolerance=0.0002))[0] < 0.31


def test_no_bf16_upper_clip_keeps_high_at_init_high():
    r8, r16, adv, mask = _outlier_batch(outliers=0)
    r8 = torch.where(adv > 0, r8 * 1.01, r8)  # an FP8 tilt: the bare balance would move H somewhere
    ctrl = CalibratedClipController(0.2, 0.2, init_low=0.6, init_high=1.8)
    metrics = ctrl.update(r8, r16, adv, mask)
    assert ctrl.bounds == (0.8, 1.8) and metrics["calib/high_no_bf16_upper_clip"] == 1.0


def test_fp8_bias_keeps_low_in_range_and_clamps():
    r8, r16, adv, mask = _data(12, bias=0.5)  # every FP8 ratio 1.65x its BF16 twin
    ctrl = CalibratedClipController(0.2, 0.2, rules=Rules(low_min=0.5, high_max=2.0))
    metrics = ctrl.update(r8, r16, adv, mask)
    low, high = ctrl.bounds
    assert low == 1.0 and metrics["calib/low_clamped"] == 1.0  # the bare rule gives L = 1.3
    assert 1.0 < high <= 2.0


def _far_tail_batch(k_far=20, m_clipped=10, n=1000):
    """A>0: n tokens at r = 1 (both), m BF16-clipped at 1.5 (both), k at r16 = 1 but r8 = 20."""
    r16 = torch.tensor([0.9] * n + [1.0] * n + [1.5] * m_clipped + [1.0] * k_far)[None]
    r8 = torch.tensor([0.9] * n + [1.0] * n + [1.5] * m_clipped + [20.0] * k_far)[None]
    adv = torch.tensor([-1.0] * n + [1.0] * (n + m_clipped + k_far))[None]
    return r8, r16, adv, torch.ones_like(adv)


def test_solution_in_a_clamped_end_bin_is_unattainable():
    r8, r16, adv, mask = _far_tail_batch()
    rules = EXACT._replace(balance="count")
    ctrl = CalibratedClipController(0.2, 0.2, rules=rules)  # range e^-2..e^2: r8 = 20 is clamped
    metrics = ctrl.update(r8, r16, adv, mask)
    assert ctrl.bounds[1] == 1.2 and metrics["calib/high_edge"] == 1.0
    assert metrics["calib/out_of_range"] == pytest.approx(20 / 2030)
    wide = CalibratedClipController(0.2, 0.2, log_ratio_range=3.5, rules=rules)  # e^3.5 = 33
    metrics = wide.update(r8, r16, adv, mask)
    # keeping the 2000 BF16-kept A>0 tokens needs H at or just below the tokens at 20 (one bin)
    assert abs(math.log(wide.bounds[1] / 20.0)) <= 7.0 / 2048 and metrics["calib/high_solved"] == 1.0


def _balance_exact(r8, r16, adv, low, eps, balance):
    """Sort-based: the smallest H with pos8(H) >= p16 * neg8(L) under one balance definition."""
    unit = {"count": lambda a, r: torch.ones_like(a), "abs_adv": lambda a, r: a.abs(),
            "abs_adv_ratio": lambda a, r: a.abs() * r}[balance]
    r8, r16, adv = r8.flatten().double(), r16.flatten().double(), adv.flatten().double()
    neg, pos = adv < 0, adv > 0
    m16, m8 = unit(adv, r16), unit(adv, r8)
    p16 = m16[pos & (r16 <= 1 + eps)].sum() / m16[neg & (r16 >= 1 - eps)].sum()
    target = p16 * m8[neg & (r8 >= low)].sum()
    order = r8[pos].argsort()
    j = int((m8[pos][order].cumsum(0) < target).sum())
    return r8[pos][order][j].item()


@pytest.mark.parametrize("balance", ["count", "abs_adv", "abs_adv_ratio"])
def test_each_balance_definition_matches_its_reference_and_all_are_logged(balance):
    g = torch.Generator().manual_seed(13)
    log16 = torch.randn(1, 30000, generator=g) * 0.15
    adv = torch.randn(1, 30000, generator=g)
    log8 = log16 + torch.where(adv < 0, -0.05, 0.0) + torch.randn(1, 30000, generator=g) * 0.05
    r8, r16, mask = log8.exp(), log16.exp(), torch.ones_like(adv)
    ctrl = CalibratedClipController(0.2, 0.2, rules=EXACT._replace(balance=balance))
    metrics = ctrl.update(r8, r16, adv, mask)
    expected = _balance_exact(r8, r16, adv, ctrl.bounds[0], 0.2, balance)
    assert abs(math.log(ctrl.bounds[1]) - math.log(expected)) <= 2 * 4.0 / 2048
    for b in ("count", "abs_adv", "abs_adv_ratio"):
        assert math.isfinite(metrics[f"calib/balance_bf16_{b}"]) and math.isfinite(metrics[f"calib/balance_fp8_{b}"])
        assert math.isfinite(metrics[f"calib/high_raw_{b}"])
    assert metrics["calib/high_raw_count"] != metrics["calib/high_raw_abs_adv_ratio"]
    with pytest.raises(ValueError, match="balance"):
        CalibratedClipController(rules=Rules(balance="mass"))


def test_loss_weights_rejected_and_dual_clipped_tokens_do_not_calibrate():
    # 100 A<0 tokens; BF16 lower-clips the 10 at r16 = 0.5, and FP8 too (r8 = 0.5)
    r16 = torch.tensor([0.5] * 10 + [1.0] * 90 + [1.0] * 100)[None]
    adv = torch.tensor([-1.0] * 100 + [1.0] * 100)[None]
    mask = torch.ones_like(adv)
    hist = RatioHistogram(0.2, 0.2, num_bins=512)
    hist.add(r16, r16, adv, mask)
    assert hist.scalar("neg_clip_ref") / hist.scalar("neg_ref") == 0.1
    # IcePop rejects exactly those 10 tokens (weight 0): the loss never sees them
    weights = torch.ones_like(adv)
    weights[0, :10] = 0.0
    hist = RatioHistogram(0.2, 0.2, num_bins=512)
    hist.add(r16, r16, adv, mask, weights=weights)
    assert hist.scalar("neg_clip_ref") == 0.0 and hist.scalar("neg_ref") == 90.0
    # dual-clip c = 3: A<0 tokens with r > 3 are held at -3A (never lower-clipped): out of the sums
    r = r16.clone()
    r[0, 10:30] = 4.0
    hist = RatioHistogram(0.2, 0.2, num_bins=512)
    hist.add(r, r, adv, mask, dual_clip=3.0)
    assert hist.scalar("neg_ref") == 80.0 and hist.scalar("neg") == 80.0
    assert hist.scalar("neg_clip_ref") / hist.scalar("neg_ref") == 10 / 80


def test_out_of_sample_scores_are_the_previous_bounds_on_the_new_batch():
    ctrl = CalibratedClipController(0.2, 0.28, rules=EXACT)
    first = ctrl.update(*_data(14))
    assert not any(k.startswith("calib/oos_") for k in first)
    low, high = ctrl.bounds
    r8, r16, adv, mask = _data(15, bias=-0.04)
    second = ctrl.update(r8, r16, adv, mask)
    v = mask.bool()
    r8, r16, adv = r8[v].double(), r16[v].double(), adv[v].double()
    neg, pos = adv < 0, adv > 0
    n_neg, n_pos = neg.sum().item(), pos.sum().item()
    false_low = (neg & (r8 < low) & (r16 >= 0.8)).sum().item() / n_neg
    missed_low = (neg & (r8 >= low) & (r16 < 0.8)).sum().item() / n_neg
    missed_high = (pos & (r8 <= high) & (r16 > 1.28)).sum().item() / n_pos
    assert second["calib/oos_false_clip_low"] == pytest.approx(false_low, abs=2e-4)
    assert second["calib/oos_missed_clip_low"] == pytest.approx(missed_low, abs=2e-4)
    assert second["calib/oos_missed_clip_high"] == pytest.approx(missed_high, abs=2e-4)
    assert second["calib/oos_clip_low_fp8"] == pytest.approx((neg & (r8 < low)).sum().item() / n_neg, abs=2e-4)
    assert second["calib/oos_clip_low_bf16"] == pytest.approx((neg & (r16 < 0.8)).sum().item() / n_neg)


def _adversarial(kind: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    n = int(torch.randint(1, 3000, (1,), generator=g))
    log16 = torch.randn(1, n, generator=g) * float(torch.rand(1, generator=g)) * 3
    log8 = log16 + torch.randn(1, n, generator=g) * float(torch.rand(1, generator=g)) + float(torch.randn(1, generator=g))
    adv = torch.randn(1, n, generator=g)
    if kind == "constant":
        log8, log16 = torch.zeros(1, n), torch.zeros(1, n)
    elif kind == "far":
        log8 = log8 * 10
    elif kind == "one_sign":
        adv = adv.abs() * (1 if n % 2 else -1)
    elif kind == "discrete":
        log8, adv = (log8 * 2).round() / 2, adv.sign()
    elif kind == "zeros":
        log8 = torch.where(torch.rand(1, n, generator=g) < 0.3, -math.inf, log8)  # r8 = 0
    weights = torch.rand(1, n, generator=g) * (torch.rand(1, n, generator=g) > 0.2)
    return log8.exp(), log16.exp(), adv, (torch.rand(1, n, generator=g) > 0.1).float(), weights


@pytest.mark.parametrize("kind", ["random", "constant", "far", "one_sign", "discrete", "zeros"])
def test_bounds_always_finite_and_in_range(kind):
    g = torch.Generator().manual_seed(16)
    rules = Rules(low_min=0.6, high_max=1.8)
    for smoothing, mode in ((1.0, "two_sided"), (0.3, "two_sided"), (1.0, "lower_only")):
        ctrl = CalibratedClipController(0.2, 0.28, smoothing=smoothing, mode=mode, num_bins=256, rules=rules)
        for _ in range(25):
            r8, r16, adv, mask, weights = _adversarial(kind, g)
            ctrl.update(r8, r16, adv, mask, weights=weights)
            low, high = ctrl.bounds
            assert math.isfinite(low) and math.isfinite(high)
            assert 0.6 <= low <= 1.0 <= high <= 1.8 and low < high


def test_loss_token_weights_are_the_factors_the_loss_applies():
    from megatron_rl.algo.policy_loss import loss_token_weights

    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    # seq-mean-token-mean: every token of a sequence of n tokens weighs 1/n; padding 0
    assert torch.allclose(loss_token_weights(mask, "seq-mean-token-mean"),
                          torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]]))
    assert torch.equal(loss_token_weights(mask, "token-mean"), mask)
    # TIS truncate at 2: w = exp(old - rollout) = (3 -> 2, 0.5, 1, 1)
    old = torch.log(torch.tensor([[3.0, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    w = loss_token_weights(mask, "token-mean", old, torch.zeros(2, 4), use_tis=True, mode="truncate", tis_clip=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]))
