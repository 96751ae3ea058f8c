"""examples/reproduce/mechanism.py's statistics on hand-made fixtures (the declared measurement of
docs/reproduction.md, "The mechanism on real weights")."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "reproduce"))
from mechanism import _most, clip_stats, log_ratio_stats, verdicts  # noqa: E402


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


def _state(std_fp, std_bf, below_fp, below_bf, false, missed, neg=100):
    return {"log_r_fp": {"std": std_fp}, "log_r_bf16": {"std": std_bf},
            "clip": {"below_fp": below_fp, "below_bf16": below_bf, "false_low": false, "missed_low": missed,
                     "neg_tokens": neg}}


def _batch(step1, step2, at_old=None, neg=100):
    at_old = at_old or _state(0.2, 0.0, 0.08, 0.0, 0.08, 0.0, neg)
    at_old["clip"]["neg_tokens"] = neg
    return {"step0": at_old, "step1": step1, "step2": step2}


def _pair(cal, default, neg=100):
    def c(below_fp, below_bf, false, missed):
        return {"below_fp": below_fp, "below_bf16": below_bf, "false_low": false, "missed_low": missed, "neg_tokens": neg}
    return {"calibrated": c(*cal), "default": c(*default)}


def test_most_is_two_of_three_or_both_of_two():
    assert [_most(f) for f in ([True, False, True], [True, False, False], [True, False], [True, True], [True], [])] \
        == [True, False, False, True, False, False]


def test_verdicts_count_only_batches_with_negative_tokens_and_need_both_states():
    up = _state(0.3, 0.1, 0.12, 0.02, 0.11, 0.01)
    empty = _batch(up, up, neg=0)  # a batch without A<0 tokens: never counted, whatever it holds
    res = {"batches": [_batch(up, up), _batch(up, up), empty], "calibrated_oos": []}
    v = verdicts(res, 2)
    assert (v["batches"], v["claim1"], v["claim2"], v["claim3"]) == (
        "2 of 3 with A<0 tokens", "confirmed", "confirmed", "confirmed as a bias")
    assert v["control"].startswith("BF16 log r exactly 0") and "2 of 2" in v["control"]
    # one of the two counted batches reverses after k steps: "most" (both of 2) fails in that state
    down = _state(0.1, 0.3, 0.01, 0.05, 0.01, 0.05)
    res["batches"][1]["step2"] = down
    v = verdicts(res, 2)
    assert (v["claim1"], v["claim2"], v["claim3"]) == ("not confirmed", "neither", "noise, not bias")
    res["batches"] = [_batch(down, down), _batch(down, down), _batch(down, down)]
    v = verdicts(res, 2)
    assert (v["claim2"], v["claim3"]) == ("contradicted", "reversed (missed exceed false)")
    # equal shares are neither above nor below
    tie = _state(0.2, 0.2, 0.05, 0.05, 0.01, 0.01)
    v = verdicts({"batches": [_batch(tie, tie)] * 3, "calibrated_oos": []}, 2)
    assert (v["claim1"], v["claim2"], v["claim3"]) == ("not confirmed", "neither", "noise, not bias")
    bad_control = _batch(up, up, at_old=_state(0.2, 1e-9, 0.1, 0.0, 0.1, 0.0))
    assert "NOT 0" in verdicts({"batches": [bad_control] * 2, "calibrated_oos": []}, 2)["control"]


def test_calibrated_bounds_are_judged_only_on_pairs_whose_scored_batch_has_negative_tokens():
    # better: closer to BF16's share (|0.03 - 0.02| < |0.13 - 0.02|) and fewer false + missed (0.02 < 0.12)
    better = _pair((0.03, 0.02, 0.01, 0.01), (0.13, 0.02, 0.11, 0.01))
    worse = _pair((0.20, 0.02, 0.18, 0.0), (0.10, 0.02, 0.08, 0.0))
    unscorable = _pair((math.nan,) * 4, (math.nan,) * 4, neg=0)
    assert verdicts({"batches": [], "calibrated_oos": [better, better]}, 2)["cc_oos"].startswith(
        "better than the default L (2 of 2")
    assert verdicts({"batches": [], "calibrated_oos": [worse, worse, better]}, 2)["cc_oos"].startswith("worse")
    assert verdicts({"batches": [], "calibrated_oos": [better, unscorable]}, 2)["cc_oos"] == (
        "not decided: better in 1, worse in 0 of 1 scorable pairs (2 in all)")
    # the default L kept (a calibration that could not move it): neither better nor worse
    same = _pair((0.13, 0.02, 0.11, 0.01), (0.13, 0.02, 0.11, 0.01))
    assert verdicts({"batches": [], "calibrated_oos": [same, same]}, 2)["cc_oos"].startswith("not decided: better in 0, worse in 0")
    # closer but with more false + missed clips is neither better nor worse
    mixed = _pair((0.03, 0.02, 0.2, 0.2), (0.13, 0.02, 0.11, 0.01))
    assert verdicts({"batches": [], "calibrated_oos": [mixed, mixed]}, 2)["cc_oos"].startswith("not decided: better in 0, worse in 0")
