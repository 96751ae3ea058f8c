"""The `calib` section: Calibrated Clipping (paper.md 1.4) and its diagnosis."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.algo.calibrated_clip import CALIB_LEVELS, controller_from_config
from megatron_rl.algo.surrogates import CLIPPED_MODES, SEQUENCE_RATIO_MODES

if TYPE_CHECKING:
    from megatron_rl.config.run import RunConfig


@dataclass
class CalibConfig:
    """Calibrated Clipping (paper.md 1.4)."""

    enabled: bool = False
    period: int = 20
    """K: recalibrate (two BF16 shadow forwards) every K steps."""
    smoothing: float = 0.5
    """EMA weight of a new L (1.0 = take it as is); H is then solved at the smoothed L so the
    applied pair still balances. Default from the ablation in docs/algo.md."""
    mode: str = "two_sided"
    """two_sided (L by quantile matching, H rebalanced) | lower_only (the one-sided ablation)."""
    num_bins: int = 2048
    """Histogram resolution over log r (the all-reduce payload does not grow with tokens)."""
    diagnose: bool = False
    """Run the BF16 shadow every `period` steps for telemetry (false-clip rate, log-ratio std)
    even when calibration is off: how the vanilla-FP8 failure is measured."""
    init_low: float | None = None
    """L before the first calibration; None = 1 - algo.eps_clip (the paper's ablation used 0.6)."""
    init_high: float | None = None
    """H before the first calibration and while H can't be solved; None = 1 + algo.eps_clip_high
    (the paper's default 1.8)."""
    low_min: float = 0.5
    """L is held in [low_min, 1]."""
    high_max: float = 2.0
    """H is held in [1, high_max]."""
    alpha_tolerance: float = 0.002
    """Match slack as a fraction of a side's (loss-weighted) tokens: any bound whose clip mass is
    within it of the BF16 target is exact, and the one closest to the BF16 bound is taken."""
    alpha_tolerance_tokens: float = 1.0
    """The same slack in tokens (the larger of the two applies): a few tokens can't move a bound."""
    balance: str = "abs_adv"
    """How a side's update mass is measured for H: count | abs_adv | abs_adv_ratio (docs/algo.md)."""
    log_ratio_range: float = 2.0
    """The histogram spans log r in [-R, R]; ratios beyond are clamped into the end bins, and a
    bound landing in such a bin is not trusted (the previous one is kept)."""
    dump_dir: str = ""
    """If set, every reduced calibration histogram is saved there (offline ablations)."""
    level: str = "token"
    """token | sequence: calibrate (L, H) on token ratios, or on GSPO's sequence ratios (one entry
    per sequence, weighted as the loss weighs it). Must match algo.loss_mode (sequence for gspo,
    gspo_token). Sequence ratios sit within ~1e-3 of 1: set log_ratio_range so that a bin is under
    a tenth of the clip band (e.g. 0.02 for eps 3e-4)."""


CHOICES = {
    "mode": ("two_sided", "lower_only"),
    "balance": ("count", "abs_adv", "abs_adv_ratio"),
    "level": CALIB_LEVELS,
}
POSITIVE = ("period", "num_bins")


def check_smoothing(c: CalibConfig) -> None:
    if not 0.0 < c.smoothing <= 1.0:
        raise ValueError(f"config key 'calib.smoothing': must be in (0, 1], got {c.smoothing}")


def check_needs_fp8(cfg: RunConfig) -> None:
    if (cfg.calib.enabled or cfg.calib.diagnose) and cfg.precision.train_recipe == "bf16":
        raise ValueError("config key 'calib.enabled': calibrated clipping calibrates FP8 against the "
                         "BF16 shadow; it needs precision.train_recipe other than 'bf16'")


def check_loss_match(cfg: RunConfig) -> None:
    """With calibration or its diagnosis on, the loss mode, the ratio level and the histogram agree."""
    if cfg.calib.enabled or cfg.calib.diagnose:
        _check_calib_level(cfg)


def check_controller(cfg: RunConfig) -> None:
    """The controller's own checks, reported against the config key they come from."""
    try:
        controller_from_config(cfg.calib, cfg.algo)
    except ValueError as err:
        key = next((k for k in ("init_low", "init_high", "low_min", "high_max", "alpha_tolerance_tokens",
                                "alpha_tolerance", "log_ratio_range") if str(err).startswith(k)), "calib")
        raise ValueError(f"config key 'calib.{key}': {err}") from None


def _check_calib_level(cfg: RunConfig) -> None:
    a, c = cfg.algo, cfg.calib
    if a.loss_mode not in CLIPPED_MODES:
        raise ValueError(f"config key 'calib.enabled': Calibrated Clipping matches the clip of the clipped "
                         f"surrogate; loss_mode={a.loss_mode!r} zeroes no gradient (use one of {list(CLIPPED_MODES)})")
    needed = "sequence" if a.loss_mode in SEQUENCE_RATIO_MODES else "token"
    if c.level != needed:
        raise ValueError(f"config key 'calib.level': loss_mode={a.loss_mode!r} clips {needed} ratios, so "
                         f"calibration must be calib.level={needed}, got {c.level!r}")
    band = min(math.log1p(a.eps_clip_high), -math.log1p(-a.eps_clip))
    width = 2.0 * c.log_ratio_range / c.num_bins
    if c.level == "sequence" and width > band / 10.0:
        raise ValueError(f"config key 'calib.log_ratio_range': a histogram bin spans {width:.3g} in log r, more "
                         f"than a tenth of the clip band ({band:.3g}); lower it to <= {band * c.num_bins / 20:.3g} "
                         f"or raise calib.num_bins")
