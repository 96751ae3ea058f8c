"""Calibrated Clipping (paper.md 1.4): FP8 ratio bounds (L, H) that clip like the BF16 shadow does.

The solves live in calib_solve.py; this module holds the controller that owns (L, H) between
calibrations: smoothing, the retry of a failed calibration, out-of-sample scoring, telemetry.

Everything is read from a RatioHistogram: fixed bins over log r8 plus exact sums, all-reduced
once, so every DP rank derives the same (L, H) without gathering per-token ratios.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algo.calib_solve import (
    HIGH_STATUSES,
    LOW_STATUSES,
    Rules,
    balance_metrics,
    check_rules,
    ratio,
    score_bounds,
    solve_high,
    solve_low,
)
from megatron_rl.algo.metrics import Reducer
from megatron_rl.algo.ratio_histogram import BALANCES, DEFAULT_LOG_RATIO_RANGE, DEFAULT_NUM_BINS, RatioHistogram
from megatron_rl.algo.surrogates import CLIPPED_MODES

CALIBRATION_MODES = ("two_sided", "lower_only")
# What one histogram entry is: a token (its ratio r_t) or a sequence (GSPO's s_i = exp(mean_t log r_t)).
CALIB_LEVELS = ("token", "sequence")
SKIP_REASONS = ("empty", "nonfinite", "no_negative", "crossed")


def _skip_reason(hist: RatioHistogram) -> str:
    if hist.scalar("nonfinite") > 0:
        return "nonfinite"
    if hist.scalar("tokens") == 0:
        return "empty"
    if hist.scalar("neg") <= 0 or hist.scalar("neg_ref") <= 0:
        return "no_negative"
    return ""


def _diagnostics(hist: RatioHistogram, balance: str) -> dict[str, float]:
    tokens = hist.scalar("tokens")
    out = {
        "calib/alpha": ratio(hist.scalar("neg_clip_ref"), hist.scalar("neg_ref")),
        "calib/tokens": tokens,
        "calib/nonfinite": hist.scalar("nonfinite"),
        "calib/out_of_range": ratio(hist.scalar("below_range") + hist.scalar("above_range"), tokens),
    }
    if hist.scalar("neg") > 0 and hist.scalar("pos") > 0:
        default = score_bounds(hist, 1.0 - hist.eps_low, 1.0 + hist.eps_high, balance)
        out.update({f"calib/default_{k}": v for k, v in default.items()})
    return out


def _smooth(old: float, new: float, weight: float) -> float:
    """EMA with `weight` on the new value."""
    return (1.0 - weight) * old + weight * new


class CalibratedClipController:
    """Holds the ratio bounds (L, H) and recalibrates them every `period` steps.

    Usage (the trainer; `reduce` is all_reduce on the DP group):
        ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28)
        low, high = ctrl.bounds                          # clip_low / clip_high of policy_loss
        if ctrl.should_calibrate(step):
            hist = ctrl.new_histogram()
            for mb in calibration_micro_batches:         # r_fp8 and the BF16 shadow's r_bf16
                hist.add(mb.ratio_fp8, mb.ratio_bf16, mb.advantages, mb.mask, weights=mb.loss_weights)
            metrics = ctrl.update_from_histogram(hist, reduce, step=step)

    Smoothing acts on the pair: L <- (1 - s) L + s L*, then H is solved from the balance at that
    smoothed L, so the applied pair balances on the calibration batch like BF16 (H is not
    averaged separately; a separately averaged pair would no longer balance). s = `smoothing`
    (1.0 = take the calibrated L). The paper "smoothly updates" the bounds without giving the rule.
    A calibration that fails (a guard rail trips) leaves the bounds and is retried on the next
    step: should_calibrate stays True until one succeeds. mode "lower_only" is the one-sided
    ablation: L calibrated, H held at 1 + eps_high. The bounds stay in [low_min, 1] x [1, high_max].
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
        rules: Rules = Rules(),
    ) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if mode not in CALIBRATION_MODES:
            raise ValueError(f"mode must be one of {CALIBRATION_MODES}, got {mode!r}")
        RatioHistogram(eps_low, eps_high, num_bins, log_ratio_range)  # validates the histogram knobs
        check_rules(rules, eps_low, eps_high)
        self.eps_low, self.eps_high, self.period, self.smoothing = eps_low, eps_high, period, smoothing
        self.num_bins, self.log_ratio_range, self.mode, self.rules = num_bins, log_ratio_range, mode, rules
        self.low = 1.0 - eps_low if init_low is None else float(init_low)
        self.high = 1.0 + eps_high if init_high is None or mode == "lower_only" else float(init_high)
        if not rules.low_min <= self.low <= 1.0:
            raise ValueError(f"init_low must be in [low_min = {rules.low_min}, 1], got {self.low}")
        if not 1.0 <= self.high <= rules.high_max or self.low >= self.high:
            raise ValueError(f"init_high must be in [1, high_max = {rules.high_max}] and > init_low, got {self.high}")
        self.num_calibrations = self.num_skipped = 0
        self.next_due = 0  # first step of the next calibration; only a success moves it on

    @property
    def bounds(self) -> tuple[float, float]:
        """The current (L, H), identical on every rank, always finite."""
        return self.low, self.high

    def should_calibrate(self, step: int) -> bool:
        """True on steps 0, period, 2 * period, ..., and on every step after one whose calibration failed."""
        return step >= self.next_due

    def new_histogram(self) -> RatioHistogram:
        """An empty histogram with this controller's eps and resolution."""
        return RatioHistogram(self.eps_low, self.eps_high, self.num_bins, self.log_ratio_range)

    def update(self, ratio_fp8: torch.Tensor, ratio_ref: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, reduce: Reducer | None = None, weights: torch.Tensor | None = None,
               step: int | None = None) -> dict[str, float]:
        """Calibrate on one (shard of a) batch; tensors [B, T] as in RatioHistogram.add."""
        hist = self.new_histogram()
        hist.add(ratio_fp8, ratio_ref, advantages, mask, weights=weights)
        return self.update_from_histogram(hist, reduce, step=step)

    def update_from_histogram(self, hist: RatioHistogram, reduce: Reducer | None = None,
                              step: int | None = None) -> dict[str, float]:
        """Reduce `hist` (unless already reduced), score the current bounds on it (calib/oos_*),
        solve, apply; returns calib/* floats. `step` places the next calibration on the grid."""
        if (hist.num_bins, hist.log_ratio_range, hist.eps_low, hist.eps_high) != (
            self.num_bins, self.log_ratio_range, self.eps_low, self.eps_high
        ):
            raise ValueError("histogram was built with other eps / num_bins / log_ratio_range than the controller")
        if not hist.reduced:
            hist.reduce(reduce)
        out = _diagnostics(hist, self.rules.balance)
        reason = _skip_reason(hist)
        if not reason and self.num_calibrations > 0:  # bounds fitted on an earlier batch, scored on this one
            out.update({f"calib/oos_{k}": v for k, v in score_bounds(hist, *self.bounds, self.rules.balance).items()})
        statuses = ("", "")
        if not reason:
            reason, statuses = self._solve_and_apply(hist, out)
        if reason:
            self.num_skipped += 1
        else:
            self.num_calibrations += 1
            self.next_due = (self.next_due if step is None else step) // self.period * self.period + self.period
        return self._metrics(out, reason, statuses)

    def _solve_and_apply(self, hist: RatioHistogram, out: dict[str, float]) -> tuple[str, tuple[str, str]]:
        low_raw, low_status = solve_low(hist, self.rules)
        low = self.low if low_raw is None else _smooth(self.low, low_raw, self.smoothing)
        high, high_status = self.high, "fixed"
        if self.mode == "two_sided":
            for b in BALANCES:  # what each balance definition would choose at this L
                out[f"calib/high_raw_{b}"] = solve_high(hist, math.log(low), self.rules, b)[0] or math.nan
            high_raw, high_status = solve_high(hist, math.log(low), self.rules)
            high = self.high if high_raw is None else high_raw
        out["calib/low_raw"] = math.nan if low_raw is None else low_raw
        out["calib/high_raw"] = high if high_status in ("solved", "clamped") else math.nan
        if not low < high:
            return "crossed", (low_status, high_status)
        self.low, self.high = low, high
        out.update({f"calib/is_{k}": v for k, v in score_bounds(hist, low, high, self.rules.balance).items()})
        out.update(balance_metrics(hist, low, high))
        out["calib/balance_bf16"] = out[f"calib/balance_bf16_{self.rules.balance}"]
        out["calib/balance_fp8"] = out[f"calib/balance_fp8_{self.rules.balance}"]
        out["calib/balance_fp8_default"] = out[f"calib/balance_fp8_default_{self.rules.balance}"]
        return "", (low_status, high_status)

    def _metrics(self, out: dict[str, float], reason: str, statuses: tuple[str, str]) -> dict[str, float]:
        out.update({
            "calib/low": self.low,
            "calib/high": self.high,
            "calib/skipped": float(bool(reason)),
            "calib/num_calibrations": float(self.num_calibrations),
            "calib/num_skipped": float(self.num_skipped),
        })
        for name in SKIP_REASONS:
            out[f"calib/skipped_{name}"] = float(reason == name)
        for name in LOW_STATUSES:
            out[f"calib/low_{name}"] = float(statuses[0] == name)
        for name in HIGH_STATUSES:
            out[f"calib/high_{name}"] = float(statuses[1] == name)
        out["calib/high_kept"] = float(statuses[1] in ("unattainable", "edge", "no_bf16_upper_clip", "undefined"))
        out["calib/clamped"] = float("clamped" in statuses)
        return out

    def state_dict(self) -> dict[str, float | int]:
        """Bounds, counters and the next due step, for the RL checkpoint."""
        return {"low": self.low, "high": self.high, "num_calibrations": self.num_calibrations,
                "num_skipped": self.num_skipped, "next_due": self.next_due}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what state_dict returned; ValueError naming a missing key (next_due may be
        absent in older checkpoints: then the next grid step after the calibrations made)."""
        for key in ("low", "high", "num_calibrations", "num_skipped"):
            if key not in state:
                raise ValueError(f"CalibratedClipController state is missing {key!r}")
        low, high = float(state["low"]), float(state["high"])
        if not (math.isfinite(high) and self.rules.low_min <= low < high <= self.rules.high_max):
            raise ValueError(f"CalibratedClipController state has bounds ({low}, {high}) outside "
                             f"[{self.rules.low_min}, 1] x [1, {self.rules.high_max}]")
        self.low, self.high = low, high
        self.num_calibrations, self.num_skipped = int(state["num_calibrations"]), int(state["num_skipped"])
        self.next_due = int(state.get("next_due", self.num_calibrations * self.period))


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
    rules: Rules = Rules(),
    weights: torch.Tensor | None = None,
) -> tuple[float, float]:
    """Calibrated (L, H) for one batch (this rank's shard; `reduce` sums over DP ranks), stateless.

    Tensors [B, T] as in RatioHistogram.add; eps_low / eps_high the BF16 bounds being matched.
    Returns finite (L, H); where a guard rail trips or a bound is kept, the uncalibrated
    1 - eps_low / 1 + eps_high stands in its place.
    """
    ctrl = CalibratedClipController(eps_low, eps_high, num_bins=num_bins or DEFAULT_NUM_BINS,
                                    log_ratio_range=log_ratio_range or DEFAULT_LOG_RATIO_RANGE, rules=rules)
    ctrl.update(ratio_fp8, ratio_ref, advantages, mask, reduce=reduce, weights=weights)
    return ctrl.bounds


def controller_from_config(calib, algo) -> CalibratedClipController:
    """The controller of a run's `calib` and `algo` config sections (duck-typed: this layer knows no
    config classes). Raises the controller's own ValueError, which starts with the knob's name, for
    a bad value: the config validates the knobs at load by calling this."""
    rules = Rules(low_min=calib.low_min, high_max=calib.high_max, alpha_tolerance=calib.alpha_tolerance,
                  alpha_tolerance_tokens=calib.alpha_tolerance_tokens, balance=calib.balance)
    # A loss mode without a gradient-zeroing clip (CISPO's weight bounds may be 0 and 5) is never
    # calibrated (the config refuses it); its controller, carried by checkpoints, keeps the defaults.
    clipped = algo.loss_mode in CLIPPED_MODES
    eps_low, eps_high = (algo.eps_clip, algo.eps_clip_high) if clipped else (0.2, 0.2)
    return CalibratedClipController(eps_low=eps_low, eps_high=eps_high, period=calib.period,
                                    smoothing=calib.smoothing, num_bins=calib.num_bins, mode=calib.mode,
                                    init_low=calib.init_low, init_high=calib.init_high,
                                    log_ratio_range=calib.log_ratio_range, rules=rules)
