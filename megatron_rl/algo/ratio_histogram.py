"""Fixed-edge histograms over log-ratios: the all-reducible summary that Calibrated Clipping reads."""

from __future__ import annotations

import math

import torch

from megatron_rl.algo.metrics import Reducer, identity_reduce

DEFAULT_NUM_BINS = 2048
# log r in [-2, 2], i.e. r in [0.135, 7.39]; with 2048 bins one bin is 0.00195 in log r (0.2% in r).
DEFAULT_LOG_RATIO_RANGE = 2.0

# Exact per-batch sums carried next to the histograms, in this order, in the same payload.
SCALARS = (
    "tokens",  # valid tokens with finite, non-negative ratios and finite advantage
    "nonfinite",  # valid tokens dropped for a NaN/inf/negative ratio or NaN advantage
    "neg",  # A < 0 tokens
    "pos",  # A > 0 tokens
    "neg_clip_ref",  # A < 0 and r_ref < 1 - eps_low: alpha's numerator
    "neg_mass_ref",  # sum |A| r_ref over A < 0, r_ref >= 1 - eps_low
    "pos_mass_ref",  # sum |A| r_ref over A > 0, r_ref <= 1 + eps_high
    "neg_clip_fp8",  # A < 0 and r_fp8 < 1 - eps_low (uncalibrated FP8 lower clips)
    "false_clip_fp8",  # ... of which r_ref >= 1 - eps_low
    "neg_mass_fp8",  # sum |A| r_fp8 over A < 0, r_fp8 >= 1 - eps_low
    "pos_mass_fp8",  # sum |A| r_fp8 over A > 0, r_fp8 <= 1 + eps_high
    "out_of_range",  # A != 0 tokens whose log r_fp8 fell outside the range (clamped to an end bin)
)


class RatioHistogram:
    """Sums over one calibration batch, fed micro-batch by micro-batch, all-reduced once.

    Payload (float64, fixed size 3 * num_bins + len(SCALARS), independent of the token count):
    [neg_count | neg_weight | pos_weight | scalars], histograms over log r_fp8 on num_bins equal
    bins spanning [-log_ratio_range, log_ratio_range]; values outside go to the end bins.
    neg_count counts A < 0 tokens (for L's quantile); neg_weight / pos_weight sum |A| * r_fp8 of
    A < 0 / A > 0 tokens (for the update-mass balance behind H). float64 keeps counts exact far
    beyond 2^24 tokens. Every rank must use the same num_bins and range.

    Usage:
        hist = RatioHistogram(eps_low, eps_high)
        for mb in calibration_micro_batches:
            hist.add(mb.ratio_fp8, mb.ratio_bf16, mb.advantages, mb.mask)
        hist.reduce(dp_all_reduce)          # one collective
    """

    def __init__(
        self,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        num_bins: int = DEFAULT_NUM_BINS,
        log_ratio_range: float = DEFAULT_LOG_RATIO_RANGE,
    ) -> None:
        if num_bins < 2:
            raise ValueError(f"num_bins must be >= 2, got {num_bins}")
        if not log_ratio_range > 0:
            raise ValueError(f"log_ratio_range must be > 0, got {log_ratio_range}")
        if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.num_bins, self.log_ratio_range = int(num_bins), float(log_ratio_range)
        self.payload = torch.zeros(3 * self.num_bins + len(SCALARS), dtype=torch.float64)
        self.reduced = False

    @property
    def bin_width(self) -> float:
        """Width of one bin in log r."""
        return 2.0 * self.log_ratio_range / self.num_bins

    @property
    def lower_edge(self) -> float:
        """Lowest edge in log r."""
        return -self.log_ratio_range

    def histogram(self, name: str) -> torch.Tensor:
        """View of one histogram: "neg_count" | "neg_weight" | "pos_weight"."""
        start = ("neg_count", "neg_weight", "pos_weight").index(name) * self.num_bins
        return self.payload[start : start + self.num_bins]

    def scalar(self, name: str) -> float:
        """One of SCALARS, as a float."""
        return float(self.payload[3 * self.num_bins + SCALARS.index(name)])

    def add(
        self, ratio_fp8: torch.Tensor, ratio_ref: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """Accumulate one micro-batch.

        Args:
            ratio_fp8: [B, T] float, pi_theta / pi_old under the FP8 trainer (any shape, all equal).
            ratio_ref: [B, T] float, the same ratio from the BF16 shadow forward.
            advantages: [B, T] float, per token. mask: [B, T] bool/0-1 response mask.
        """
        if self.reduced:
            raise RuntimeError("RatioHistogram.add after reduce(): start a new histogram per calibration")
        for name, t in (("ratio_ref", ratio_ref), ("advantages", advantages), ("mask", mask)):
            if t.shape != ratio_fp8.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(ratio_fp8.shape)} like ratio_fp8")
        r8, rr, adv = (t.detach().reshape(-1) for t in (ratio_fp8, ratio_ref, advantages))
        valid = mask.detach().reshape(-1).bool()
        finite = torch.isfinite(r8) & torch.isfinite(rr) & torch.isfinite(adv) & (r8 >= 0) & (rr >= 0)
        keep = valid & finite
        self._add_scalar("nonfinite", (valid & ~finite).sum())
        self._add_tokens(r8[keep].double(), rr[keep].double(), adv[keep].double())

    def _add_tokens(self, r8: torch.Tensor, rr: torch.Tensor, adv: torch.Tensor) -> None:
        low, high = 1.0 - self.eps_low, 1.0 + self.eps_high
        neg, pos = adv < 0, adv > 0
        log8 = torch.log(r8)  # log(0) = -inf is clamped into the first bin below
        idx = ((log8.clamp(-self.log_ratio_range, self.log_ratio_range) - self.lower_edge) / self.bin_width).floor()
        idx = idx.long().clamp(0, self.num_bins - 1)
        weight = adv.abs() * r8
        nb = self.num_bins
        self.payload[:nb] += torch.bincount(idx[neg], minlength=nb).double()
        side = idx + nb * pos.long()  # [neg_weight | pos_weight]
        self.payload[nb : 3 * nb] += torch.bincount(side[neg | pos], weights=weight[neg | pos], minlength=2 * nb)
        ref_clip, fp8_clip = neg & (rr < low), neg & (r8 < low)
        sums = {
            "tokens": adv.numel(),
            "neg": neg.sum(),
            "pos": pos.sum(),
            "neg_clip_ref": ref_clip.sum(),
            "neg_mass_ref": (adv.abs() * rr)[neg & ~(rr < low)].sum(),
            "pos_mass_ref": (adv.abs() * rr)[pos & (rr <= high)].sum(),
            "neg_clip_fp8": fp8_clip.sum(),
            "false_clip_fp8": (fp8_clip & ~ref_clip).sum(),
            "neg_mass_fp8": weight[neg & ~(r8 < low)].sum(),
            "pos_mass_fp8": weight[pos & (r8 <= high)].sum(),
            "out_of_range": ((neg | pos) & (log8.abs() > self.log_ratio_range)).sum(),
        }
        for name, value in sums.items():
            self._add_scalar(name, value)

    def _add_scalar(self, name: str, value: torch.Tensor | float) -> None:
        self.payload[3 * self.num_bins + SCALARS.index(name)] += float(value)

    def reduce(self, reduce: Reducer | None = None) -> None:
        """Sum the payload across ranks with ONE call of `reduce` (in-place all_reduce on the DP group)."""
        if self.reduced:
            raise RuntimeError("RatioHistogram.reduce called twice: the payload would be summed twice")
        self.payload = (reduce or identity_reduce)(self.payload)
        self.reduced = True

    def payload_bytes(self) -> int:
        """Bytes moved by the all-reduce (independent of the number of tokens)."""
        return self.payload.numel() * self.payload.element_size()


def invert_cumulative(hist: torch.Tensor, target: float, lower_edge: float, bin_width: float,
                      prefer: float | None = None) -> float | None:
    """A log r at which the cumulative of `hist` reaches `target`, uniform within each bin.

    Without `prefer`: the smallest such log r. target <= 0 gives the lower edge of the first
    non-empty bin (nothing lies below it); a target above the total gives None (not attainable).
    The answer lies in the bin where the crossing happens, within one bin width of the exact
    order statistic.

    With `prefer` (a log r, e.g. the BF16 bound): the cumulative is flat across empty bins, so
    when `target` is reached exactly at a bin end, every point up to the next non-empty bin is an
    equally exact solution (empirical quantiles are intervals between order statistics). Return
    the one closest to `prefer`: when FP8 and BF16 clip the same tokens the bound stays at the
    BF16 value instead of jumping to the edge of a gap in a sparse tail.
    """
    nonempty = torch.nonzero(hist > 0).flatten()
    if target <= 0.0:
        first = lower_edge + (int(nonempty[0]) if nonempty.numel() else 0) * bin_width
        return first if prefer is None else min(prefer, first)
    cum = hist.cumsum(0)
    total = float(cum[-1])
    # Relative slack for float64 round-off of a weighted cumsum against a target built from sums.
    slack = 1e-12 * max(abs(total), 1.0)
    if target > total + slack:
        return None
    i = min(int(torch.searchsorted(cum, torch.tensor([min(target, total)], dtype=cum.dtype))), hist.numel() - 1)
    before = float(cum[i - 1]) if i > 0 else 0.0
    frac = min(max((target - before) / float(hist[i]), 0.0), 1.0)
    smallest = lower_edge + (i + frac) * bin_width
    if prefer is None or prefer <= smallest or float(cum[i]) > target + slack:  # crossed inside bin i
        return smallest
    later = nonempty[nonempty > i]
    flat_end = lower_edge + int(later[0]) * bin_width if later.numel() else math.inf
    return min(prefer, flat_end)


def mass_at_or_above(hist: torch.Tensor, log_value: float, lower_edge: float, bin_width: float) -> float:
    """Sum of `hist` at log r >= log_value, with the bin holding log_value split uniformly."""
    if math.isinf(log_value):
        return float(hist.sum()) if log_value < 0 else 0.0
    pos = (log_value - lower_edge) / bin_width
    i = min(max(int(math.floor(pos)), 0), hist.numel() - 1)
    frac = min(max(pos - i, 0.0), 1.0)
    return float(hist[i]) * (1.0 - frac) + float(hist[i + 1 :].sum())
