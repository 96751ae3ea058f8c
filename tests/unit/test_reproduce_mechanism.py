"""examples/reproduce/mechanism.py's statistics on hand-made fixtures (the declared measurement of
docs/reproduction.md, "The mechanism on real weights")."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "reproduce"))
from mechanism import clip_stats, log_ratio_stats  # noqa: E402


def _log(*ratios):
    return torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)


def test_clip_stats_counts_false_and_missed_lower_clips_per_negative_token():
    # tokens: four A<0, one A>0 (ignored), one A<0 outside the mask (ignored), one A<0 tie at L
    fp = _log(0.7, 0.9, 0.7, 0.95, 0.5, 0.1, 0.8)
    bf = _log(0.7, 0.7, 0.9, 0.95, 0.5, 0.1, 0.8)
    adv = torch.tensor([[-1.0, -1.0, -2.0, -0.5, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 1]])
    s = clip_stats(fp, bf, adv, mask, 0.8, 0.8)
    # 5 A<0 tokens; below L: fp {0, 2}, bf16 {0, 1} (the tie at 0.8 is not clipped: r < L strictly)
    assert (s.neg_tokens, s.below_fp, s.below_bf16, s.false_low, s.missed_low) == (5, 0.4, 0.4, 0.2, 0.2)
    # a calibrated L for the recipe's ratio, BF16 still judged at 1 - eps: fp below 0.92 = {0, 1, 2, 6}
    s = clip_stats(fp, bf, adv, mask, 0.92, 0.8)
    assert (s.below_fp, s.false_low, s.missed_low) == (0.8, 0.4, 0.0)


def test_clip_stats_without_negative_tokens_is_nan():
    s = clip_stats(_log(0.5), _log(0.5), torch.tensor([[1.0]]), torch.ones(1, 1), 0.8, 0.8)
    assert s.neg_tokens == 0 and math.isnan(s.below_fp) and math.isnan(s.false_low)


def test_log_ratio_stats_over_response_tokens():
    log_r = torch.tensor([[-0.3, -0.1, 0.0, 0.1, 0.3, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    out = log_ratio_stats(log_r, mask, 0.8, 1.2)
    # population std of (-0.3, -0.1, 0, 0.1, 0.3): sqrt(0.2 / 5) = 0.2; outside [log 0.8, log 1.2]: +-0.3
    assert out["std"] == pytest.approx(0.2, abs=1e-12) and out["outside"] == pytest.approx(0.4)
    assert out["q0.1"] == pytest.approx(-0.3 + 0.004 * 0.2, abs=1e-9)  # linear interpolation, 0.1% of 4 gaps
    assert out["q99.9"] == pytest.approx(0.3 - 0.004 * 0.2, abs=1e-9)
