"""Calibrated Clipping (paper.md 1.4): FP8 ratio bounds (L, H) that clip like the BF16 shadow does.

On a calibration batch with FP8 ratios r8, BF16 shadow ratios r16 and advantages A:
  alpha = P(r16 < 1 - eps_low | A < 0)       same fraction lower-clipped as BF16 would
  L     = the alpha-quantile of r8 over A < 0 tokens
  p16   = pos16 / neg16,   pos16 = sum_{A>0, r16 <= 1+eps_high} |A| r16,
                           neg16 = sum_{A<0, r16 >= 1-eps_low} |A| r16
  H     = smallest H with pos8(H) = p16 * neg8(L),
          pos8(H) = sum_{A>0, r8 <= H} |A| r8,   neg8(L) = sum_{A<0, r8 >= L} |A| r8
A side's mass sums |A| r over its unclipped tokens: the magnitude of d(r A)/dlogpi. When even
H = inf leaves pos8 below the target, no H attains the balance and H = inf (no upper clip).

Everything is read from a RatioHistogram: fixed bins over log r8 plus exact sums, all-reduced
once, so every DP rank derives the same (L, H) without gathering per-token ratios; L is within
one bin width (in log r) of the exact quantile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from megatron_rl.algo.metrics import Reducer
from megatron_rl.algo.ratio_histogram import (
    DEFAULT_LOG_RATIO_RANGE,
    DEFAULT_NUM_BINS,
    RatioHistogram,
    invert_cumulative,
    mass_at_or_above,
)

CALIBRATION_MODES = ("two_sided", "lower_only")


class Calibration(NamedTuple):
    """Result of one calibration; low / high are None where the guard rails say keep the previous."""

    low: float | None
    high: float | None
    skip_reason: str  # "" | "empty" | "nonfinite" | "no_negative" | "crossed"
    high_status: str  # "solved" | "unbounded" (no H attains the balance) | "kept" | "fixed" (lower_only)
    metrics: dict[str, float]


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _solve_high(hist: RatioHistogram, log_low: float) -> tuple[float | None, str, float]:
    """H from the balance; returns (H or None, status, BF16 balance p16)."""
    neg16, pos16 = hist.scalar("neg_mass_ref"), hist.scalar("pos_mass_ref")
    if hist.scalar("pos") == 0 or neg16 <= 0:
        return None, "kept", _ratio(pos16, neg16)
    p16 = pos16 / neg16
    neg8 = mass_at_or_above(hist.histogram("neg_weight"), log_low, hist.lower_edge, hist.bin_width)
    log_high = invert_cumulative(hist.histogram("pos_weight"), p16 * neg8, hist.lower_edge, hist.bin_width,
                                 prefer=math.log1p(hist.eps_high))
    if log_high is None:
        return math.inf, "unbounded", p16
    return math.exp(log_high), "solved", p16


def _balance_fp8(hist: RatioHistogram, low: float, high: float) -> float:
    """pos8(H) / neg8(L) read from the histograms (bins holding L or H split uniformly)."""
    edge, width = hist.lower_edge, hist.bin_width
    pos_total = float(hist.histogram("pos_weight").sum())
    pos_kept = pos_total - mass_at_or_above(hist.histogram("pos_weight"), math.log(high), edge, width)
    neg_kept = mass_at_or_above(hist.histogram("neg_weight"), math.log(low) if low > 0 else -math.inf, edge, width)
    return _ratio(pos_kept, neg_kept)


def _skip_reason(hist: RatioHistogram) -> str:
    if hist.scalar("nonfinite") > 0:
        return "nonfinite"
    if hist.scalar("tokens") == 0:
        return "empty"
    if hist.scalar("neg") == 0:
        return "no_negative"
    return ""


def _diagnostics(hist: RatioHistogram) -> dict[str, float]:
    neg, tokens = hist.scalar("neg"), hist.scalar("tokens")
    return {
        "calib/alpha": _ratio(hist.scalar("neg_clip_ref"), neg),
        "calib/balance_bf16": _ratio(hist.scalar("pos_mass_ref"), hist.scalar("neg_mass_ref")),
        "calib/balance_fp8": math.nan,  # at the new bounds; set once solved
        "calib/balance_fp8_default": _ratio(hist.scalar("pos_mass_fp8"), hist.scalar("neg_mass_fp8")),
        "calib/clipfrac_low_fp8_default": _ratio(hist.scalar("neg_clip_fp8"), neg),
        "calib/false_clip_default": _ratio(hist.scalar("false_clip_fp8"), neg),
        "calib/out_of_range": _ratio(hist.scalar("out_of_range"), tokens),
        "calib/tokens": tokens,
        "calib/nonfinite": hist.scalar("nonfinite"),
    }


def solve_bounds(hist: RatioHistogram, solve_high: bool = True) -> Calibration:
    """(L, H) from a reduced histogram. Deterministic, so identical on every rank.

    Guard rails (bounds None = keep the previous ones): NaN/inf ratios anywhere, an empty batch, no
    A < 0 tokens: skip. No A > 0 tokens or no unclipped A < 0 BF16 mass (balance undefined): L
    only. L >= H: skip ("crossed"). `solve_high=False` (lower_only ablation) leaves H alone.
    """
    metrics = _diagnostics(hist)
    reason = _skip_reason(hist)
    if reason:
        return Calibration(None, None, reason, "kept", metrics)
    alpha_count = hist.scalar("neg_clip_ref")
    log_low = invert_cumulative(hist.histogram("neg_count"), alpha_count, hist.lower_edge, hist.bin_width,
                                prefer=math.log1p(-hist.eps_low))
    assert log_low is not None, "the alpha-quantile target never exceeds the A < 0 count"
    low = math.exp(log_low)
    high, high_status = None, "fixed"
    if solve_high:
        high, high_status, _ = _solve_high(hist, log_low)
    if high is not None and low >= high:
        return Calibration(None, None, "crossed", high_status, metrics)
    if high is not None:
        metrics["calib/balance_fp8"] = _balance_fp8(hist, low, high)
    return Calibration(low, high, "", high_status, metrics)


def calibrate_bounds(
    ratio_fp8: torch.Tensor,
    ratio_ref: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    num_bins: int | None = None,
    reduce: Reducer | None = None,
    log_ratio_range: float | None = None,
) -> tuple[float, float]:
    """Calibrated (L, H) for one batch (this rank's shard; `reduce` sums over DP ranks).

    Args:
        ratio_fp8: [B, T] float, FP8 trainer ratio pi_theta / pi_old.
        ratio_ref: [B, T] float, BF16 shadow ratio of the same tokens.
        advantages: [B, T] float; mask: [B, T] bool/0-1.
        eps_low, eps_high: the BF16 bounds 1 - eps_low, 1 + eps_high being matched.
        num_bins, log_ratio_range: histogram resolution (defaults 2048 bins over log r in [-2, 2]).
        reduce: in-place sum across ranks (all_reduce bound to the DP group), called once.

    Returns:
        (L, H) as floats; H may be inf (no upper clip). Where a guard rail trips (see solve_bounds)
        the uncalibrated bound 1 - eps_low / 1 + eps_high is returned in its place.
    """
    hist = RatioHistogram(eps_low, eps_high, num_bins or DEFAULT_NUM_BINS, log_ratio_range or DEFAULT_LOG_RATIO_RANGE)
    hist.add(ratio_fp8, ratio_ref, advantages, mask)
    hist.reduce(reduce)
    result = solve_bounds(hist)
    low = 1.0 - eps_low if result.low is None else result.low
    high = 1.0 + eps_high if result.high is None else result.high
    return low, high


def _smooth(old: float, new: float, weight: float) -> float:
    """EMA with `weight` on the new value; an infinite end (no upper clip) is taken as is."""
    if math.isinf(old) or math.isinf(new):
        return new
    return (1.0 - weight) * old + weight * new


class CalibratedClipController:
    """Holds the ratio bounds (L, H) and recalibrates them every `period` steps.

    Usage (the trainer; `reduce` is all_reduce on the DP group):
        ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28)
        low, high = ctrl.bounds                          # clip_low / clip_high of policy_loss
        if ctrl.should_calibrate(step):
            hist = ctrl.new_histogram()
            for mb in calibration_micro_batches:         # r_fp8 and the BF16 shadow's r_bf16
                hist.add(mb.ratio_fp8, mb.ratio_bf16, mb.advantages, mb.mask)
            metrics = ctrl.update_from_histogram(hist, reduce)

    Smoothing: L <- (1 - s) L + s L*, likewise H, with s = `smoothing` (1.0 = take the calibrated
    value). The paper "smoothly updates" the bounds without giving the rule; this EMA is ours.
    mode "lower_only" is the one-sided ablation: L calibrated, H held at 1 + eps_high.
    """

    def __init__(
        self,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        period: int = 20,
        smoothing: float = 1.0,
        init_low: float | None = None,
        init_high: float | None = None,
        num_bins: int = DEFAULT_NUM_BINS,
        log_ratio_range: float = DEFAULT_LOG_RATIO_RANGE,
        mode: str = "two_sided",
    ) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if mode not in CALIBRATION_MODES:
            raise ValueError(f"mode must be one of {CALIBRATION_MODES}, got {mode!r}")
        RatioHistogram(eps_low, eps_high, num_bins, log_ratio_range)  # validates the histogram knobs
        self.eps_low, self.eps_high, self.period, self.smoothing = eps_low, eps_high, period, smoothing
        self.num_bins, self.log_ratio_range, self.mode = num_bins, log_ratio_range, mode
        self.low = 1.0 - eps_low if init_low is None else float(init_low)
        self.high = 1.0 + eps_high if init_high is None else float(init_high)
        if mode == "lower_only":
            self.high = 1.0 + eps_high
        if not 0.0 <= self.low < self.high:
            raise ValueError(f"need 0 <= init_low < init_high, got init_low={self.low}, init_high={self.high}")
        self.num_calibrations = 0
        self.num_skipped = 0

    @property
    def bounds(self) -> tuple[float, float]:
        """The current (L, H), identical on every rank."""
        return self.low, self.high

    def should_calibrate(self, step: int) -> bool:
        """True on steps 0, period, 2 * period, ..."""
        return step % self.period == 0

    def new_histogram(self) -> RatioHistogram:
        """An empty histogram with this controller's eps and resolution."""
        return RatioHistogram(self.eps_low, self.eps_high, self.num_bins, self.log_ratio_range)

    def update(
        self,
        ratio_fp8: torch.Tensor,
        ratio_ref: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        reduce: Reducer | None = None,
    ) -> dict[str, float]:
        """Calibrate on one (shard of a) batch; tensors [B, T] as in calibrate_bounds."""
        hist = self.new_histogram()
        hist.add(ratio_fp8, ratio_ref, advantages, mask)
        return self.update_from_histogram(hist, reduce)

    def update_from_histogram(self, hist: RatioHistogram, reduce: Reducer | None = None) -> dict[str, float]:
        """Reduce `hist` (unless already reduced), solve, smooth into the bounds; returns calib/* floats."""
        if (hist.num_bins, hist.log_ratio_range, hist.eps_low, hist.eps_high) != (
            self.num_bins, self.log_ratio_range, self.eps_low, self.eps_high
        ):
            raise ValueError("histogram was built with other eps / num_bins / log_ratio_range than the controller")
        if not hist.reduced:
            hist.reduce(reduce)
        result = solve_bounds(hist, solve_high=self.mode == "two_sided")
        reason = result.skip_reason
        low = self.low if result.low is None else _smooth(self.low, result.low, self.smoothing)
        high = self.high if result.high is None else _smooth(self.high, result.high, self.smoothing)
        if not reason and low >= high:
            reason = "crossed"
        if reason:
            self.num_skipped += 1
        else:
            self.low, self.high = low, high
            self.num_calibrations += 1
        return self._metrics(result, reason)

    def _metrics(self, result: Calibration, reason: str) -> dict[str, float]:
        out = dict(result.metrics)
        out.update({
            "calib/low": self.low,
            "calib/high": self.high,
            "calib/low_raw": math.nan if result.low is None else result.low,
            "calib/high_raw": math.nan if result.high is None else result.high,
            "calib/skipped": float(bool(reason)),
            "calib/high_unbounded": float(result.high_status == "unbounded"),
            "calib/high_kept": float(result.high_status == "kept" and not reason),
            "calib/num_calibrations": float(self.num_calibrations),
            "calib/num_skipped": float(self.num_skipped),
        })
        for name in ("empty", "nonfinite", "no_negative", "crossed"):
            out[f"calib/skipped_{name}"] = float(reason == name)
        return out

    def state_dict(self) -> dict[str, float | int]:
        """Bounds and counters, for the RL checkpoint."""
        return {
            "low": self.low,
            "high": self.high,
            "num_calibrations": self.num_calibrations,
            "num_skipped": self.num_skipped,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what state_dict returned; ValueError naming a missing key."""
        for key in ("low", "high", "num_calibrations", "num_skipped"):
            if key not in state:
                raise ValueError(f"CalibratedClipController state is missing {key!r}")
        self.low, self.high = float(state["low"]), float(state["high"])
        self.num_calibrations, self.num_skipped = int(state["num_calibrations"]), int(state["num_skipped"])
