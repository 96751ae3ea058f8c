"""Value tests of Calibrated Clipping's histogram, scores and controller (algo/ratio_histogram.py,
calib_solve.py, calibrated_clip.py) against slow per-token references written from the docstrings:
every payload entry, every calib/* score and balance, each status and skip flag, the tolerance in
weighted tokens, and each config knob reaching the controller. Ties sit on the thresholds: ratios
exactly at 1 - eps_low / 1 + eps_high / the dual-clip c, log-ratios exactly on bin edges and on the
ends of the range (eps 0.25 and 0.5 and a bin width of 0.5 are exact in binary)."""

from __future__ import annotations

import bisect
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.calib_solve import Rules, score_bounds
from megatron_rl.algo.calibrated_clip import CalibratedClipController, controller_from_config
from megatron_rl.algo.ratio_histogram import BALANCES, HISTOGRAMS, SCALARS, RatioHistogram

EPS_LOW, EPS_HIGH = 0.25, 0.5  # 1 - eps_low = 0.75 and 1 + eps_high = 1.5 exactly
RANGE, BINS = 2.0, 8  # edges -2, -1.5, ..., 2: exact
EDGES = [-RANGE + i * (2 * RANGE / BINS) for i in range(BINS + 1)]
# ratios on the thresholds, on bin edges (e^-2, e^-1, 1, e^1, e^2 round-trip exactly), outside the
# range, at the dual-clip c = 4, and invalid ones
RATIO = st.sampled_from([0.0, math.exp(-3.0), math.exp(-2.0), math.exp(-1.0), 0.5, 0.75, 0.9, 1.0, 1.2, 1.5,
                         math.exp(1.0), 4.0, 5.0, math.exp(2.0), 9.0, math.nan, math.inf, -1.0])
ADV = st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, math.nan])
WEIGHT = st.sampled_from([0.0, 0.25, 1.0, 2.0, 1.0, -1.0, math.inf])
TOKEN = st.tuples(RATIO, RATIO, ADV, st.booleans(), WEIGHT)
FAST = settings(max_examples=60, deadline=None)


def _bin(log_r: float) -> int:
    """The bin of log r: the last edge at or below it, end bins for everything outside."""
    return min(max(bisect.bisect_right(EDGES, log_r) - 1, 0), BINS - 1)


def _log(r: float) -> float:
    return -math.inf if r == 0 else math.log(r)


def _reference_payload(tokens, dual_clip):
    """Every HISTOGRAMS bin and SCALARS entry, token by token, from the docstrings."""
    h = {name: [0.0] * BINS for name in HISTOGRAMS}
    s = dict.fromkeys(SCALARS, 0.0)
    c = math.inf if dual_clip is None else dual_clip
    for r8, rr, a, valid, w in tokens:
        if not valid:
            continue
        ok = all(math.isfinite(x) for x in (r8, rr, a, w)) and r8 >= 0 and rr >= 0 and w >= 0
        if not ok:
            s["nonfinite"] += 1
            continue
        s["tokens"] += 1
        w8 = 0.0 if (a < 0 and r8 > c) else w  # dual-clipped A<0 tokens leave the FP8 sums
        wr = 0.0 if (a < 0 and rr > c) else w  # ... and, on their own ratio, the BF16 sums
        if w8 > 0 and a != 0:
            side = "neg" if a < 0 else "pos"
            b = _bin(_log(r8))
            for balance, value in (("count", w8), ("abs_adv", w8 * abs(a)), ("abs_adv_ratio", w8 * abs(a) * r8)):
                h[f"{side}_{balance}"][b] += value
            s[f"{side}_tokens"] += 1
            s[side] += w8
            if side == "neg" and rr >= 1 - EPS_LOW:
                h["neg_ref_kept"][b] += w8
            if side == "pos" and rr > 1 + EPS_HIGH:
                h["pos_ref_clipped"][b] += w8
            s["below_range"] += _log(r8) < -RANGE
            s["above_range"] += _log(r8) > RANGE
        if wr > 0 and a != 0:
            side = "neg" if a < 0 else "pos"
            kept = rr >= 1 - EPS_LOW if a < 0 else rr <= 1 + EPS_HIGH
            for balance, value in (("count", wr), ("abs_adv", wr * abs(a)), ("abs_adv_ratio", wr * abs(a) * rr)):
                s[f"{side}_mass_ref_{balance}"] += value * kept
            if a < 0:
                s["neg_ref"] += wr
                s["neg_clip_ref"] += wr * (not kept)
            else:
                s["pos_clip_ref"] += wr * (rr > 1 + EPS_HIGH)
    return h, s


def _tensors(tokens):
    cols = list(zip(*tokens))
    r8, rr, adv, valid, w = (torch.tensor([list(c)], dtype=torch.float64) for c in cols)
    return r8, rr, adv, valid.bool(), w


@FAST
@given(st.lists(TOKEN, min_size=0, max_size=24), st.sampled_from([None, 4.0]), st.integers(1, 3))
def test_every_payload_entry_matches_a_token_by_token_reference(tokens, dual_clip, parts):
    hist = RatioHistogram(EPS_LOW, EPS_HIGH, BINS, RANGE)
    if tokens:
        r8, rr, adv, valid, w = _tensors(tokens)
        cut = [round(i * len(tokens) / parts) for i in range(parts + 1)]
        for a, b in zip(cut, cut[1:]):  # micro-batches of unequal size
            hist.add(r8[:, a:b], rr[:, a:b], adv[:, a:b], valid[:, a:b], weights=w[:, a:b], dual_clip=dual_clip)
    h, s = _reference_payload(tokens, dual_clip)
    for name in HISTOGRAMS:
        assert hist.histogram(name).tolist() == pytest.approx(h[name], abs=1e-12), name
    for name in SCALARS:
        assert hist.scalar(name) == pytest.approx(s[name], abs=1e-12), name


def test_bin_edges_belong_to_the_bin_above_and_the_range_ends_are_not_out_of_range():
    ends = [math.exp(-2.0), 1.0, math.exp(1.0), math.exp(2.0), math.exp(-2.0) * 0.999, math.exp(2.0) * 1.001]
    r = torch.tensor([ends], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    hist = RatioHistogram(EPS_LOW, EPS_HIGH, BINS, RANGE)
    hist.add(r, r, adv, torch.ones_like(adv))
    # log r = -2 -> bin 0 (in range); 0 -> bin 4; 1 -> bin 6; 2 -> the last bin (in range); beyond: clamped
    assert hist.histogram("neg_count").tolist() == [2.0, 0, 0, 0, 1.0, 0, 1.0, 0]
    assert hist.histogram("pos_count").tolist() == [0, 0, 0, 0, 0, 0, 0, 2.0]
    assert hist.scalar("below_range") == 1.0 and hist.scalar("above_range") == 1.0
    # r_ref exactly 1 - eps_low is kept by BF16 (not clipped); exactly 1 + eps_high is not upper-clipped
    hist = RatioHistogram(EPS_LOW, EPS_HIGH, BINS, RANGE)
    ties = torch.tensor([[0.75, 0.75, 1.5, 1.5]], dtype=torch.float64)
    hist.add(ties, ties, torch.tensor([[-1.0, -1.0, 1.0, 1.0]], dtype=torch.float64), torch.ones(1, 4))
    assert hist.scalar("neg_clip_ref") == 0.0 and hist.scalar("pos_clip_ref") == 0.0
    assert hist.scalar("neg_mass_ref_count") == 2.0 and hist.scalar("pos_mass_ref_count") == 2.0


def test_merge_adds_a_payload_as_if_its_tokens_were_added():
    g = torch.Generator().manual_seed(0)
    r8, rr, adv = (torch.rand(3, 50, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    adv = adv - 1.0
    mask = torch.ones_like(adv)
    whole, a, b = (RatioHistogram(EPS_LOW, EPS_HIGH, BINS, RANGE) for _ in range(3))
    whole.add(r8, rr, adv, mask)
    a.add(r8[:1], rr[:1], adv[:1], mask[:1])
    b.add(r8[1:], rr[1:], adv[1:], mask[1:])
    a.merge(b.payload)
    assert torch.allclose(a.payload, whole.payload, rtol=1e-13, atol=0)


# ---- scores of any (L, H): per-token references with the histogram's uniform-in-bin rule ------


def _below(tokens, x, pred, unit):
    """Sum of unit(token) over tokens with pred, each split uniformly over its bin (log r < x)."""
    width = EDGES[1] - EDGES[0]
    total = 0.0
    for t in tokens:
        if pred(t):
            left = EDGES[_bin(_log(t[0]))]
            total += unit(t) * min(max((x - left) / width, 0.0), 1.0)
    return total


def _units(balance, side_ratio=0):
    return {"count": lambda t: t[4], "abs_adv": lambda t: t[4] * abs(t[2]),
            "abs_adv_ratio": lambda t: t[4] * abs(t[2]) * t[side_ratio]}[balance]


def _reference_scores(tokens, low, high, balance):
    neg = [t for t in tokens if t[2] < 0 and t[4] > 0]
    pos = [t for t in tokens if t[2] > 0 and t[4] > 0]
    n_neg, n_pos = sum(t[4] for t in neg), sum(t[4] for t in pos)
    w = _units("count")
    lo, hi = math.log(low), math.log(high)
    low_clip = _below(neg, lo, lambda t: True, w)
    false_low = _below(neg, lo, lambda t: t[1] >= 1 - EPS_LOW, w)
    ref_clip_low = sum(t[4] for t in neg if t[1] < 1 - EPS_LOW)
    high_clip = n_pos - _below(pos, hi, lambda t: True, w)
    ref_clip_high = sum(t[4] for t in pos if t[1] > 1 + EPS_HIGH)
    ref_clip_high_below = _below(pos, hi, lambda t: t[1] > 1 + EPS_HIGH, w)
    u8, u16 = _units(balance, 0), _units(balance, 1)
    fp8 = _below(pos, hi, lambda t: True, u8) / (sum(u8(t) for t in neg) - _below(neg, lo, lambda t: True, u8))
    bf16 = (sum(u16(t) for t in pos if t[1] <= 1 + EPS_HIGH) / sum(u16(t) for t in neg if t[1] >= 1 - EPS_LOW))
    return {
        "clip_low_fp8": low_clip / n_neg,
        "clip_low_bf16": ref_clip_low / n_neg,
        "false_clip_low": false_low / n_neg,
        "missed_clip_low": (ref_clip_low - (low_clip - false_low)) / n_neg,
        "clip_high_fp8": high_clip / n_pos,
        "clip_high_bf16": ref_clip_high / n_pos,
        "false_clip_high": (high_clip - (ref_clip_high - ref_clip_high_below)) / n_pos,
        "missed_clip_high": ref_clip_high_below / n_pos,
        "balance_err": fp8 / bf16 - 1.0,
    }, fp8, bf16


def _scored_batch(seed, n=60):
    """Tokens (r8, r_ref, A, valid, w) with unequal weights, both signs, ratios spread over bins."""
    g = torch.Generator().manual_seed(seed)
    r8 = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 0.4).tolist()
    rr = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 0.4).tolist()
    adv = (torch.randn(n, generator=g, dtype=torch.float64)).tolist()
    w = (torch.rand(n, generator=g, dtype=torch.float64) + 0.1).tolist()
    return [(a, b, c, True, d) for a, b, c, d in zip(r8, rr, adv, w)]


@pytest.mark.parametrize("balance", BALANCES)
@pytest.mark.parametrize("low, high", [(0.75, 1.5), (math.exp(-0.5), math.exp(0.5)), (0.6, 1.1)])
def test_scores_of_any_bounds_match_the_per_token_reference(balance, low, high):
    tokens = _scored_batch(1)
    hist = RatioHistogram(EPS_LOW, EPS_HIGH, BINS, RANGE)
    hist.add(*_tensors(tokens))
    expected, _, _ = _reference_scores(tokens, low, high, balance)
    got = score_bounds(hist, low, high, balance)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_the_controllers_default_in_sample_and_balance_metrics_are_those_of_its_bounds():
    tokens = _scored_batch(2, n=400)
    rules = Rules(low_min=0.3, high_max=3.0, alpha_tolerance=0.0, alpha_tolerance_tokens=0.0, balance="abs_adv")
    ctrl = CalibratedClipController(EPS_LOW, EPS_HIGH, num_bins=BINS, log_ratio_range=RANGE, rules=rules)
    m = ctrl.update(*_tensors(tokens)[:4], weights=_tensors(tokens)[4])
    low, high = ctrl.bounds
    assert m["calib/skipped"] == 0.0 and (m["calib/low"], m["calib/high"]) == (low, high)
    default, fp8_default, bf16 = _reference_scores(tokens, 1 - EPS_LOW, 1 + EPS_HIGH, "abs_adv")
    applied, fp8, _ = _reference_scores(tokens, low, high, "abs_adv")
    for key in default:
        assert m[f"calib/default_{key}"] == pytest.approx(default[key], rel=1e-9, abs=1e-12), key
        assert m[f"calib/is_{key}"] == pytest.approx(applied[key], rel=1e-9, abs=1e-12), key
    for b in BALANCES:  # every balance definition, at the applied and at the default bounds
        _, fp8_b, bf16_b = _reference_scores(tokens, low, high, b)
        _, fp8_default_b, _ = _reference_scores(tokens, 1 - EPS_LOW, 1 + EPS_HIGH, b)
        assert m[f"calib/balance_bf16_{b}"] == pytest.approx(bf16_b, rel=1e-9)
        assert m[f"calib/balance_fp8_{b}"] == pytest.approx(fp8_b, rel=1e-9)
        assert m[f"calib/balance_fp8_default_{b}"] == pytest.approx(fp8_default_b, rel=1e-9)
    # the unsuffixed balances are the ones of the configured rule (abs_adv), not another definition
    assert (m["calib/balance_bf16"], m["calib/balance_fp8"], m["calib/balance_fp8_default"]) == pytest.approx(
        (bf16, fp8, fp8_default))
    neg = [t for t in tokens if t[2] < 0]
    alpha = sum(t[4] for t in neg if t[1] < 0.75) / sum(t[4] for t in neg)
    assert m["calib/alpha"] == pytest.approx(alpha, rel=1e-12)
    assert m["calib/tokens"] == 400.0 and m["calib/nonfinite"] == 0.0


def test_alpha_tokens_and_out_of_range_count_every_valid_token_not_only_one_sign():
    # 4 valid tokens (one A = 0, one masked, one NaN): out_of_range is over the 4 counted tokens
    r8 = torch.tensor([[0.01, 50.0, 1.0, 1.0, 0.01, 1.0, math.nan]], dtype=torch.float64)
    rr = torch.tensor([[0.5, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, -1.0, 0.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1]])
    weights = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    ctrl = CalibratedClipController(EPS_LOW, EPS_HIGH, num_bins=BINS, log_ratio_range=RANGE)
    m = ctrl.update(r8[:, :6], rr[:, :6], adv[:, :6], mask[:, :6], weights=weights[:, :6])
    assert m["calib/tokens"] == 5.0 and m["calib/out_of_range"] == pytest.approx(2 / 5)
    assert m["calib/alpha"] == pytest.approx(3 / 4)  # weighted: the r_ref = 0.5 token weighs 3 of 4
    m = ctrl.update(r8, rr, adv, mask, weights=weights)
    assert m["calib/nonfinite"] == 1.0 and m["calib/skipped_nonfinite"] == 1.0


# ---- the controller's decisions ------------------------------------------------------------------


def _biased_up(n=2000):
    """FP8 ratios 1.65x their BF16 twins (L solves above 1 and is clamped to 1); BF16 upper-clips
    no A>0 token (r_ref <= 1.1), so H is kept."""
    g = torch.Generator().manual_seed(3)
    r16 = 0.6 + 0.5 * torch.rand(1, n, generator=g, dtype=torch.float64)
    adv = torch.where(torch.rand(1, n, generator=g) < 0.5, -1.0, 1.0).double()
    return r16 * 1.65, r16, adv, torch.ones_like(adv)


def test_crossed_bounds_are_skipped_keep_the_previous_pair_and_are_retried():
    ctrl = CalibratedClipController(0.2, 0.2, period=5, init_low=0.8, init_high=1.0)
    m = ctrl.update(*_biased_up(), step=0)
    # L clamped to 1 and H kept at 1: not L < H, so nothing is applied
    assert m["calib/low_clamped"] == 1.0 and m["calib/high_no_bf16_upper_clip"] == 1.0
    assert m["calib/skipped"] == 1.0 and m["calib/skipped_crossed"] == 1.0 and m["calib/clamped"] == 1.0
    assert m["calib/high_kept"] == 1.0
    assert ctrl.bounds == (0.8, 1.0) and (m["calib/low"], m["calib/high"]) == (0.8, 1.0)
    assert m["calib/num_skipped"] == 1.0 and m["calib/num_calibrations"] == 0.0
    assert ctrl.should_calibrate(1)  # retried on the next step, not at step 5
    assert not any(k.startswith("calib/is_") for k in m)  # nothing applied: no in-sample scores
    # with room above 1 the same batch calibrates: L = 1 (clamped), H kept
    ctrl = CalibratedClipController(0.2, 0.2, period=5, init_high=1.3)
    m = ctrl.update(*_biased_up(), step=0)
    assert ctrl.bounds == (1.0, 1.3) and m["calib/skipped"] == 0.0 and not ctrl.should_calibrate(4)
    assert m["calib/low_raw"] == 1.0 and math.isnan(m["calib/high_raw"])


def test_out_of_sample_scores_need_an_earlier_success_and_a_good_batch():
    r8, r16, adv, mask = _biased_up()
    ctrl = CalibratedClipController(0.2, 0.2, init_high=1.0)
    assert not any(k.startswith("calib/oos_") for k in ctrl.update(r8, r16, adv, mask))  # crossed: no success yet
    ctrl = CalibratedClipController(0.2, 0.2, init_high=1.3)
    ctrl.update(r8, r16, adv, mask)
    skipped = ctrl.update(r8, r16, adv.abs(), mask)  # no A<0 token: skipped, nothing to score
    assert skipped["calib/skipped_no_negative"] == 1.0 and not any(k.startswith("calib/oos_") for k in skipped)
    scored = ctrl.update(r8, r16, adv, mask)
    tokens = [(a, b, c, True, 1.0) for a, b, c in zip(r8[0].tolist(), r16[0].tolist(), adv[0].tolist())]
    hist = ctrl.new_histogram()
    hist.add(r8, r16, adv, mask)
    expected = score_bounds(hist, 1.0, 1.3, "abs_adv")  # the bounds in force before this calibration
    assert {k[len("calib/oos_"):]: v for k, v in scored.items() if k.startswith("calib/oos_")} == expected
    neg = [t for t in tokens if t[2] < 0]
    assert expected["clip_low_bf16"] == sum(t[1] < 0.8 for t in neg) / len(neg)


def test_the_token_tolerance_is_counted_in_weighted_tokens():
    # 2000 A<0 tokens of weight 0.25 that BF16 and FP8 both keep, one FP8 outlier at r8 = 0.3 (BF16 keeps
    # it): alpha = 0. With a one-token tolerance at the mean weight (~0.25), an outlier weighing 0.2
    # is inside it and L stays 0.8; one weighing 0.3 is not, and L drops to the outlier's bin.
    n = 2000
    r16 = torch.full((1, n + 1), 0.95, dtype=torch.float64)
    r8 = r16.clone()
    r8[0, 0] = 0.3
    adv = -torch.ones_like(r16)
    rules = Rules(low_min=0.1, high_max=2.0, alpha_tolerance=0.0, alpha_tolerance_tokens=1.0)
    bounds = {}
    for w_out in (0.2, 0.3):
        w = torch.full_like(r16, 0.25)
        w[0, 0] = w_out
        ctrl = CalibratedClipController(0.2, 0.2, num_bins=2048, rules=rules)
        ctrl.update(r8, r16, adv, torch.ones_like(adv), weights=w)
        bounds[w_out] = ctrl.bounds[0]
    assert bounds[0.2] == pytest.approx(0.8)
    assert abs(math.log(bounds[0.3]) - math.log(0.3)) <= 4.0 / 2048


@pytest.mark.parametrize("loss_mode, eps", [("vanilla", (0.15, 0.35)), ("gspo", (0.15, 0.35)), ("cispo", (0.2, 0.2))])
def test_every_calib_knob_reaches_the_controller(loss_mode, eps):
    calib = SimpleNamespace(low_min=0.55, high_max=1.9, alpha_tolerance=0.003, alpha_tolerance_tokens=2.5,
                            balance="count", period=7, smoothing=0.4, num_bins=96, mode="lower_only",
                            init_low=0.7, init_high=1.6, log_ratio_range=2.5)
    algo = SimpleNamespace(loss_mode=loss_mode, eps_clip=0.15, eps_clip_high=0.35)
    ctrl = controller_from_config(calib, algo)
    assert ctrl.rules == Rules(0.55, 1.9, 0.003, 2.5, "count")
    assert (ctrl.eps_low, ctrl.eps_high) == eps  # CISPO's weight bounds are never calibrated
    knobs = (ctrl.period, ctrl.smoothing, ctrl.num_bins, ctrl.mode, ctrl.log_ratio_range)
    assert knobs == (7, 0.4, 96, "lower_only", 2.5)
    assert ctrl.bounds == (0.7, 1.0 + eps[1])  # lower_only: H held at 1 + eps_high, not init_high
    hist = ctrl.new_histogram()
    assert (hist.num_bins, hist.log_ratio_range, hist.eps_low, hist.eps_high) == (96, 2.5, *eps)
    two_sided = controller_from_config(SimpleNamespace(**{**vars(calib), "mode": "two_sided"}), algo)
    assert two_sided.bounds == (0.7, 1.6)
    assert [two_sided.should_calibrate(s) for s in (0, 1)] == [True, True]
    two_sided.next_due = 7
    assert [two_sided.should_calibrate(s) for s in (6, 7)] == [False, True]


def test_a_checkpoint_without_next_due_resumes_on_the_grid_after_its_calibrations():
    ctrl = CalibratedClipController(0.2, 0.2, period=4)
    ctrl.load_state_dict({"low": 0.7, "high": 1.3, "num_calibrations": 3, "num_skipped": 2})
    assert ctrl.bounds == (0.7, 1.3) and (ctrl.num_calibrations, ctrl.num_skipped) == (3, 2)
    assert [ctrl.should_calibrate(s) for s in (11, 12)] == [False, True]
    with pytest.raises(ValueError, match="outside"):  # low above high is refused
        ctrl.load_state_dict({"low": 1.3, "high": 1.2, "num_calibrations": 1, "num_skipped": 0})


# ---- the quantile interval and the sequence entries -----------------------------------------------


@FAST
@given(st.lists(st.sampled_from([0.0, 0.0, 1.0, 2.0, 0.5]), min_size=2, max_size=8), st.data())
def test_the_solution_interval_is_where_the_cumulative_lies_between_the_targets(counts, data):
    """Brute force over a grid of 1/64 bin reaching past both ends: every x in [a, b] has
    low <= C(x) <= high, every grid x outside has not; flat stretches (empty bins) belong to the
    interval; C is 0 below the range and the total above it."""
    from megatron_rl.algo.ratio_histogram import cumulative_below, solution_interval

    hist = torch.tensor(counts, dtype=torch.float64)
    total = float(hist.sum())
    low_t = data.draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 1.5, 2.0, total, total + 0.5]))
    high_t = max(low_t, 0.0) + data.draw(st.sampled_from([0.0, 0.25, 1.0]))  # the solves' upper targets are >= 0
    got = solution_interval(hist, low_t, high_t, -1.0, 0.5)
    grid = [-2.0 + i * 0.5 / 64 for i in range(64 * (len(counts) + 4) + 1)]  # two bins beyond each end
    inside = [x for x in grid if low_t - 1e-9 <= cumulative_below(hist, x, -1.0, 0.5) <= high_t + 1e-9]
    if low_t > total:
        assert got is None
        return
    a, b = got
    for x in grid:
        assert (a - 1e-9 <= x <= b + 1e-9) == (x in inside) or min(abs(x - a), abs(x - b)) < 1e-9, (x, a, b)
    assert (a == -math.inf) == (low_t <= 0) and (b == math.inf) == (high_t >= total)


@FAST
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([-1.0, 0.5, 2.0])), min_size=1, max_size=5),
       st.sampled_from([None, 1.05]))
def test_sequence_entries_are_the_geometric_mean_ratio_mean_advantage_and_summed_weight(rows, dual_clip):
    """add_sequences against add() of one entry per sequence built by hand: s_i = exp(mean_t log r_t)
    under FP8 and BF16, A_i the mean advantage, w_i the sum of the weights, rows without tokens out."""
    T = 4
    g = torch.Generator().manual_seed(len(rows))
    log8 = torch.randn(len(rows), T, generator=g, dtype=torch.float64) * 0.2
    log16 = torch.randn(len(rows), T, generator=g, dtype=torch.float64) * 0.2
    mask = torch.tensor([[t < n for t in range(T)] for n, _ in rows])
    adv = torch.tensor([[a] * T for _, a in rows], dtype=torch.float64) + torch.rand(len(rows), T, generator=g) * 0.1
    w = torch.rand(len(rows), T, generator=g, dtype=torch.float64)
    hist = RatioHistogram(EPS_LOW, EPS_HIGH, BINS, RANGE)
    hist.add_sequences(log8, log16, adv, mask, weights=w, dual_clip=dual_clip)
    entries = []
    for i, (n, _) in enumerate(rows):
        if n == 0:
            continue
        mean = lambda t: sum(t[i, :n].tolist()) / n  # noqa: E731
        entries.append((math.exp(mean(log8)), math.exp(mean(log16)), mean(adv), sum(w[i, :n].tolist())))
    ref = RatioHistogram(EPS_LOW, EPS_HIGH, BINS, RANGE)
    if entries:
        r8, r16, a, ww = (torch.tensor([list(c)], dtype=torch.float64) for c in zip(*entries))
        ref.add(r8, r16, a, torch.ones_like(a), weights=ww, dual_clip=dual_clip)
    assert torch.allclose(hist.payload, ref.payload, rtol=1e-12, atol=1e-12)
    assert hist.scalar("tokens") == len(entries)


def test_calibrate_bounds_uses_every_knob_it_is_given():
    """The stateless helper against a controller built with the same knobs, on a batch where each
    knob changes the answer (the range holds the far tokens or not; the weights move alpha; the
    rules' balance moves H)."""
    from megatron_rl.algo.calibrated_clip import calibrate_bounds

    g = torch.Generator().manual_seed(21)
    n = 6000
    log16 = torch.randn(1, n, generator=g, dtype=torch.float64) * 0.3
    log8 = log16 + torch.randn(1, n, generator=g, dtype=torch.float64) * 0.1 - 0.05
    adv = torch.randn(1, n, generator=g, dtype=torch.float64)
    mask = torch.ones(1, n)
    weights = torch.where(log16 < -0.2, 3.0, 1.0).double()  # BF16-clipped tokens weigh 3x: alpha grows
    rules = Rules(low_min=0.3, high_max=3.0, alpha_tolerance=0.0, alpha_tolerance_tokens=0.0, balance="count")
    knobs = dict(num_bins=512, log_ratio_range=0.5, rules=rules, weights=weights)
    got = calibrate_bounds(log8.exp(), log16.exp(), adv, mask, 0.2, 0.28, **knobs)
    ctrl = CalibratedClipController(0.2, 0.28, num_bins=512, log_ratio_range=0.5, rules=rules)
    ctrl.update(log8.exp(), log16.exp(), adv, mask, weights=weights)
    assert got == ctrl.bounds
    for knob, other in (("num_bins", 64), ("log_ratio_range", 2.0), ("rules", rules._replace(balance="abs_adv_ratio")),
                        ("weights", None)):
        changed = calibrate_bounds(log8.exp(), log16.exp(), adv, mask, 0.2, 0.28, **{**knobs, knob: other})
        assert changed != got, knob
