"""Calibrated Clipping on GSPO's sequence ratios: the token-level rule fed one entry per sequence,
checked against the exact sort-based reference on sequence ratios, and its robustness rules."""

import math

import pytest
import torch

from megatron_rl.algo.calibrated_clip import CalibratedClipController
from megatron_rl.algo.policy_loss import loss_token_weights
from megatron_rl.algo.ratio_histogram import RatioHistogram
from tests.unit.test_algo_calibrated_clip import EXACT, _balance, _exact_reference

EPS_LOW, EPS_HIGH = 3e-4, 4e-4  # GSPO's
RANGE = 0.01  # log r in [-0.01, 0.01]: a bin of 1e-5 at 2048 bins, a thirtieth of the band
SEQ_RULES = EXACT._replace(low_min=0.99, high_max=1.01)


def _sequences(seed, n_seq=3000, max_len=48, bias=-1e-4):
    """Token log-ratios [S, T]: BF16 = per-sequence offset + token noise; FP8 = BF16 + biased noise."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, max_len + 1, (n_seq,), generator=g)
    mask = (torch.arange(max_len) < lengths[:, None]).float()
    log16 = torch.randn(n_seq, 1, generator=g) * 3e-4 + torch.randn(n_seq, max_len, generator=g) * 1e-3
    log8 = log16 + torch.randn(n_seq, max_len, generator=g) * 2e-3 + bias
    adv = torch.randn(n_seq, 1, generator=g).expand(n_seq, max_len).contiguous()
    return log8 * mask, log16 * mask, adv, mask


def _per_sequence(log8, log16, adv, mask):
    """The obvious reduction: s = exp(sum log r / n) per row, the row's advantage, [S, 1] each."""
    log8, log16, mask = log8.double(), log16.double(), mask.double()
    n = mask.sum(dim=1, keepdim=True)
    return ((log8 * mask).sum(1, keepdim=True) / n).exp(), ((log16 * mask).sum(1, keepdim=True) / n).exp(), adv[:, :1]


def _controller(rules=SEQ_RULES, **kw):
    return CalibratedClipController(EPS_LOW, EPS_HIGH, log_ratio_range=RANGE, rules=rules, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequence_bounds_match_the_exact_reference_on_sequence_ratios(seed):
    log8, log16, adv, mask = _sequences(seed)
    ctrl = _controller()
    # seq-mean-token-mean: each token weighs 1 / n_i, so each sequence weighs 1
    weights = loss_token_weights(mask, "seq-mean-token-mean")
    hist = ctrl.new_histogram()
    hist.add_sequences(log8, log16, adv, mask, weights=weights)
    ctrl.update_from_histogram(hist)
    low, high = ctrl.bounds
    s8, s16, seq_adv = _per_sequence(log8, log16, adv, mask)
    (q_lo, q_hi), high_exact, p16 = _exact_reference(s8, s16, seq_adv, torch.ones_like(s8), EPS_LOW, EPS_HIGH, low)
    width = 2 * RANGE / 2048
    assert math.log(q_lo) - width <= math.log(low) <= math.log(q_hi) + width
    assert abs(math.log(high) - math.log(high_exact)) <= width
    assert _balance(s8, seq_adv, torch.ones_like(s8), low, high) == pytest.approx(p16, rel=5e-3)
    neg = seq_adv < 0
    alpha16, alpha8 = ((s16 < 1 - EPS_LOW) & neg).sum() / neg.sum(), ((s8 < low) & neg).sum() / neg.sum()
    assert alpha8.item() == pytest.approx(alpha16.item(), abs=2e-3)
    # the biased FP8 noise over-clips A<0 sequences at the uncalibrated bound: what calibration fixes
    assert ((s8 < 1 - EPS_LOW) & neg).sum() > ((s16 < 1 - EPS_LOW) & neg).sum()
    assert low < 1 - EPS_LOW


def test_held_out_batch_scores_the_fitted_bounds_out_of_sample():
    ctrl = _controller()
    for seed in (3, 4):  # fit on one batch, score on the next (calib/oos_*)
        log8, log16, adv, mask = _sequences(seed)
        hist = ctrl.new_histogram()
        hist.add_sequences(log8, log16, adv, mask, weights=loss_token_weights(mask, "seq-mean-token-mean"))
        out = ctrl.update_from_histogram(hist)
    assert abs(out["calib/oos_clip_low_fp8"] - out["calib/oos_clip_low_bf16"]) < 0.02
    assert abs(out["calib/default_clip_low_fp8"] - out["calib/default_clip_low_bf16"]) > 0.05


def test_sequence_entries_are_the_token_weight_sums_of_the_loss():
    log8, log16, adv, mask = _sequences(5, n_seq=40)
    rollout = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * 0.3
    weights = loss_token_weights(mask, "token-mean", torch.zeros_like(mask), rollout, use_tis=True,
                                 level="sequence", tis_clip=2.0)
    hist = RatioHistogram(EPS_LOW, EPS_HIGH, log_ratio_range=RANGE)
    hist.add_sequences(log8, log16, adv, mask, weights=weights)
    s8, s16, seq_adv = _per_sequence(log8, log16, adv, mask)
    by_hand = RatioHistogram(EPS_LOW, EPS_HIGH, log_ratio_range=RANGE)
    # token-mean: sequence i weighs n_i tokens times its (sequence-level) TIS weight
    seq_w = torch.exp(-(rollout * mask).double().sum(1, keepdim=True)).clamp(max=2.0) * mask.sum(1, keepdim=True)
    by_hand.add(s8, s16, seq_adv, torch.ones_like(s8), weights=seq_w)
    assert torch.allclose(hist.payload, by_hand.payload, rtol=1e-6, atol=1e-9)
    assert hist.scalar("tokens") == 40  # counted in sequences


def _one_outlier_sequence(outliers=1, n_seq=4000, length=16):
    """BF16 sequence ratios within 1 -/+ 2e-4 (no clip); FP8 equal, except `outliers` A<0 sequences
    whose every token is at log r = -0.004 (s = 0.996, far below 1 - 3e-4)."""
    g = torch.Generator().manual_seed(11)
    log16 = (torch.rand(n_seq, 1, generator=g) * 4e-4 - 2e-4).expand(n_seq, length).contiguous()
    log8 = log16.clone()
    log8[:outliers] = -0.004
    adv = torch.cat([-torch.ones(n_seq // 2), torch.ones(n_seq - n_seq // 2)])[:, None].expand(n_seq, length)
    return log8, log16, adv.contiguous(), torch.ones(n_seq, length)


def test_a_single_sequence_cannot_swing_the_bounds():
    log8, log16, adv, mask = _one_outlier_sequence()
    weights = loss_token_weights(mask, "token-mean")  # 16 tokens each: tolerance is one sequence, not one token
    bare, robust = _controller(), _controller(rules=SEQ_RULES._replace(alpha_tolerance_tokens=1.0))
    for ctrl in (bare, robust):
        hist = ctrl.new_histogram()
        hist.add_sequences(log8, log16, adv, mask, weights=weights)
        ctrl.update_from_histogram(hist)
    # the bare rule: BF16 clips nothing, so any L at or below the outlier's 0.996 is exact
    assert bare.bounds[0] == pytest.approx(math.exp(-0.004), abs=2e-5)
    assert robust.bounds[0] == 1 - EPS_LOW
    # 20 outliers are more than the tolerance: they move L
    log8, log16, adv, mask = _one_outlier_sequence(outliers=20)
    ctrl = _controller(rules=SEQ_RULES._replace(alpha_tolerance_tokens=1.0))
    hist = ctrl.new_histogram()
    hist.add_sequences(log8, log16, adv, mask, weights=weights)
    ctrl.update_from_histogram(hist)
    assert ctrl.bounds[0] < 0.9965


def test_ranges_and_kept_bounds_at_sequence_level():
    log8, log16, adv, mask = _sequences(6, n_seq=500)
    # L is held at low_min; a sequence beyond the range lands in the end bin and is counted
    log8[0] = -1.0 * mask[0]
    log8 = log8 - 5e-3 * mask  # FP8 biased far down: the matched L would fall below low_min
    ctrl = _controller(rules=SEQ_RULES._replace(low_min=0.9996, alpha_tolerance_tokens=1.0))
    hist = ctrl.new_histogram()
    hist.add_sequences(log8, log16, adv, mask)
    out = ctrl.update_from_histogram(hist)
    assert ctrl.bounds[0] == pytest.approx(0.9996) and out["calib/low_clamped"] == 1.0
    assert out["calib/out_of_range"] == pytest.approx(1 / 500)
    # a NaN token makes its sequence non-finite: the calibration is skipped and the bounds kept
    log8[1, 0] = float("nan")
    hist = ctrl.new_histogram()
    hist.add_sequences(log8, log16, adv, mask)
    out = ctrl.update_from_histogram(hist)
    assert out["calib/skipped_nonfinite"] == 1.0 and ctrl.bounds[0] == pytest.approx(0.9996)
