"""The two solves of Calibrated Clipping (paper.md 1.4) and the scoring of any (L, H) on a histogram.

All quantities are loss-weighted (RatioHistogram.add takes the loss's per-token weights).
  alpha = P(r16 < 1 - eps_low | A < 0)
  L     = a log r8 where the FP8 lower-clip mass matches alpha within the tolerance, the one
          closest to 1 - eps_low; then held in [low_min, 1]
  p16   = pos16 / neg16 (BF16 unclipped masses under 1 -/+ eps, measured by `balance`)
  H     = a log r8 where pos8(H) matches p16 * neg8(L) within the tolerance, the one closest to
          1 + eps_high; then held in [1, high_max]. None (keep the previous H) when no H attains
          the balance, when the solution lies in an end bin holding clamped ratios, or when BF16
          upper-clips (almost) nothing: the balance then barely constrains H.
The tolerance keeps a few tokens from moving a bound: any bound within it is as good as exact,
so the bound stays at the BF16 value unless the match really needs it to move.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from megatron_rl.algo.ratio_histogram import BALANCES, RatioHistogram, solution_interval

LOW_STATUSES = ("solved", "clamped", "edge")
HIGH_STATUSES = ("solved", "clamped", "unattainable", "edge", "no_bf16_upper_clip", "undefined", "fixed")


class Rules(NamedTuple):
    """The knobs of the solves (config: calib.low_min, high_max, alpha_tolerance(_tokens), balance)."""

    low_min: float = 0.5
    high_max: float = 2.0
    alpha_tolerance: float = 0.002  # fraction of the side's (weighted) total
    alpha_tolerance_tokens: float = 1.0  # tokens, at the side's mean weight per token
    balance: str = "abs_adv"


def check_rules(rules: Rules, eps_low: float, eps_high: float) -> None:
    """ValueError naming the knob when the rules can't hold the default bounds."""
    if not 0.0 < rules.low_min <= 1.0 - eps_low:
        raise ValueError(f"low_min must be in (0, 1 - eps_low = {1.0 - eps_low}], got {rules.low_min}")
    if not rules.high_max >= 1.0 + eps_high:
        raise ValueError(f"high_max must be >= 1 + eps_high = {1.0 + eps_high}, got {rules.high_max}")
    if not 0.0 <= rules.alpha_tolerance < 1.0:
        raise ValueError(f"alpha_tolerance must be in [0, 1), got {rules.alpha_tolerance}")
    if not rules.alpha_tolerance_tokens >= 0.0:
        raise ValueError(f"alpha_tolerance_tokens must be >= 0, got {rules.alpha_tolerance_tokens}")
    if rules.balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {rules.balance!r}")


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def tolerance(total: float, tokens: float, rules: Rules) -> float:
    """Slack in the side's own units: a fraction of its total, or a number of average tokens."""
    return max(rules.alpha_tolerance * total, rules.alpha_tolerance_tokens * ratio(total, tokens) if tokens else 0.0)


def _closest(interval: tuple[float, float], prefer: float) -> float:
    return min(max(prefer, interval[0]), interval[1])


def solve_low(hist: RatioHistogram, rules: Rules) -> tuple[float | None, str]:
    """(L or None = keep the previous, status); needs A < 0 tokens."""
    neg = hist.scalar("neg")
    target = ratio(hist.scalar("neg_clip_ref"), hist.scalar("neg_ref")) * neg
    tol = tolerance(neg, hist.scalar("neg_tokens"), rules)
    interval = solution_interval(hist.histogram("neg_count"), target - tol, target + tol, hist.lower_edge,
                                 hist.bin_width)
    assert interval is not None, "alpha * total never exceeds the total"
    log_low = _closest(interval, math.log1p(-hist.eps_low))
    if hist.in_clamped_bin(log_low):
        return None, "edge"
    low = math.exp(log_low)
    if not rules.low_min <= low <= 1.0:
        return min(max(low, rules.low_min), 1.0), "clamped"
    return low, "solved"


def bf16_balance(hist: RatioHistogram, balance: str) -> float:
    return ratio(hist.scalar(f"pos_mass_ref_{balance}"), hist.scalar(f"neg_mass_ref_{balance}"))


def solve_high(hist: RatioHistogram, log_low: float, rules: Rules, balance: str | None = None) -> tuple[float | None, str]:
    """(H or None = keep the previous, status) balancing the FP8 masses at L like BF16's."""
    balance = balance or rules.balance
    if hist.scalar("pos") <= 0 or not hist.scalar(f"neg_mass_ref_{balance}") > 0:
        return None, "undefined"
    if hist.scalar("pos_clip_ref") <= tolerance(hist.scalar("pos"), hist.scalar("pos_tokens"), rules):
        return None, "no_bf16_upper_clip"
    pos_hist = hist.histogram(f"pos_{balance}")
    target = bf16_balance(hist, balance) * hist.above(f"neg_{balance}", log_low)
    tol = tolerance(float(pos_hist.sum()), hist.scalar("pos_tokens"), rules)
    interval = solution_interval(pos_hist, target - tol, target + tol, hist.lower_edge, hist.bin_width)
    if interval is None:
        return None, "unattainable"
    log_high = _closest(interval, math.log1p(hist.eps_high))
    if hist.in_clamped_bin(log_high):
        return None, "edge"
    high = math.exp(log_high)
    if not 1.0 <= high <= rules.high_max:
        return min(max(high, 1.0), rules.high_max), "clamped"
    return high, "solved"


def score_bounds(hist: RatioHistogram, low: float, high: float, balance: str) -> dict[str, float]:
    """How (L, H) clip the histogram's tokens next to BF16 at 1 -/+ eps (fractions of that sign's
    loss-weighted tokens; ratios inside a bin taken as uniform in log r)."""
    log_low, log_high = math.log(low) if low > 0 else -math.inf, math.log(high)
    neg, pos = hist.scalar("neg"), hist.scalar("pos")
    low_clip, false_low = hist.cumulative("neg_count", log_low), hist.cumulative("neg_ref_kept", log_low)
    ref_clipped_neg = neg - float(hist.histogram("neg_ref_kept").sum())
    high_clip = hist.above("pos_count", log_high)
    missed_high = hist.cumulative("pos_ref_clipped", log_high)
    balance_fp8 = ratio(hist.cumulative(f"pos_{balance}", log_high), hist.above(f"neg_{balance}", log_low))
    balance_bf16 = bf16_balance(hist, balance)
    return {
        "clip_low_fp8": ratio(low_clip, neg),
        "clip_low_bf16": ratio(hist.scalar("neg_clip_ref"), hist.scalar("neg_ref")),
        "false_clip_low": ratio(false_low, neg),
        "missed_clip_low": ratio(ref_clipped_neg - (low_clip - false_low), neg),
        "clip_high_fp8": ratio(high_clip, pos),
        "clip_high_bf16": ratio(hist.scalar("pos_clip_ref"), pos),
        "false_clip_high": ratio(high_clip - hist.above("pos_ref_clipped", log_high), pos),
        "missed_clip_high": ratio(missed_high, pos),
        "balance_err": ratio(balance_fp8, balance_bf16) - 1.0,
    }


def balance_metrics(hist: RatioHistogram, low: float, high: float) -> dict[str, float]:
    """Every balance definition at once: BF16's, and FP8's at (L, H) and at 1 -/+ eps."""
    out = {}
    default = (1.0 - hist.eps_low, 1.0 + hist.eps_high)
    for b in BALANCES:
        out[f"calib/balance_bf16_{b}"] = bf16_balance(hist, b)
        for name, (lo, hi) in (("", (low, high)), ("_default", default)):
            num = hist.cumulative(f"pos_{b}", math.log(hi))
            out[f"calib/balance_fp8{name}_{b}"] = ratio(num, hist.above(f"neg_{b}", math.log(lo) if lo > 0 else -math.inf))
    return out
