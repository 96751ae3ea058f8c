"""Fixed-edge histograms over log-ratios: the all-reducible summary that Calibrated Clipping reads."""

from __future__ import annotations

import math

import torch

from megatron_rl.algo.metrics import Reducer, identity_reduce
from megatron_rl.algo.surrogates import LOG_RATIO_CLAMP, sequence_mean

DEFAULT_NUM_BINS = 2048
# log r in [-2, 2], i.e. r in [0.135, 7.39]; with 2048 bins one bin is 0.00195 in log r (0.2% in r).
DEFAULT_LOG_RATIO_RANGE = 2.0

# How a side's update mass is measured (the balance behind H): per unclipped token, the loss weight
# w times 1 ("count"), |A| ("abs_adv") or |A| r ("abs_adv_ratio", the magnitude of d(rA)/dlog pi).
BALANCES = ("count", "abs_adv", "abs_adv_ratio")

# Histograms over log r_fp8, all holding loss weights w (TIS / IcePop x sequence aggregation):
HISTOGRAMS = (
    "neg_count", "neg_abs_adv", "neg_abs_adv_ratio",  # A < 0 tokens: w, w|A|, w|A|r8
    "pos_count", "pos_abs_adv", "pos_abs_adv_ratio",  # A > 0 tokens
    "neg_ref_kept",  # A < 0 tokens that BF16 keeps (r_ref >= 1 - eps_low): false lower clips below L
    "pos_ref_clipped",  # A > 0 tokens that BF16 upper-clips (r_ref > 1 + eps_high): missed clips below H
)

# Exact weighted sums carried next to the histograms, in this order, in the same payload. "ref"
# sums use the BF16 ratio (and its dual-clip exclusion); the others the FP8 one.
SCALARS = (
    "tokens",  # valid tokens with finite, non-negative ratios and finite advantage (unweighted)
    "nonfinite",  # valid tokens dropped for a NaN/inf/negative ratio, advantage or weight
    "neg_tokens", "pos_tokens",  # unweighted A < 0 / A > 0 token counts (FP8 side)
    "neg", "pos",  # weighted A < 0 / A > 0 totals (FP8 side; = the count histograms' totals)
    "neg_ref",  # weighted A < 0 total on the BF16 side: alpha's denominator
    "neg_clip_ref",  # weighted A < 0 with r_ref < 1 - eps_low: alpha's numerator
    "pos_clip_ref",  # weighted A > 0 with r_ref > 1 + eps_high: BF16's upper clips
    *(f"neg_mass_ref_{b}" for b in BALANCES),  # BF16 unclipped A < 0 mass, per balance
    *(f"pos_mass_ref_{b}" for b in BALANCES),  # BF16 unclipped A > 0 mass, per balance
    "below_range", "above_range",  # A != 0 tokens clamped into the first / last bin (unweighted)
)


class RatioHistogram:
    """Sums over one calibration batch, fed micro-batch by micro-batch, all-reduced once.

    Payload (float64, fixed size len(HISTOGRAMS) * num_bins + len(SCALARS), independent of the
    token count): the histograms over log r_fp8 on num_bins equal bins spanning
    [-log_ratio_range, log_ratio_range] (values outside are clamped into the end bins and counted
    in below_range / above_range), then the scalars. Every token enters with its loss weight, so
    calibration sees the tokens as the loss does. float64 keeps counts exact far beyond 2^24
    tokens. Every rank must use the same num_bins and range.

    Usage:
        hist = RatioHistogram(eps_low, eps_high)
        for mb in calibration_micro_batches:
            hist.add(mb.ratio_fp8, mb.ratio_bf16, mb.advantages, mb.mask, weights=mb.loss_weights)
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
        self.payload = torch.zeros(len(HISTOGRAMS) * self.num_bins + len(SCALARS), dtype=torch.float64)
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
        """View of one of HISTOGRAMS."""
        start = HISTOGRAMS.index(name) * self.num_bins
        return self.payload[start : start + self.num_bins]

    def scalar(self, name: str) -> float:
        """One of SCALARS, as a float."""
        return float(self.payload[len(HISTOGRAMS) * self.num_bins + SCALARS.index(name)])

    def bin_of(self, log_r: float) -> int:
        """Index of the bin holding log r (end bins for values outside the range)."""
        return min(max(int(math.floor((log_r - self.lower_edge) / self.bin_width)), 0), self.num_bins - 1)

    def in_clamped_bin(self, log_r: float) -> bool:
        """True when log r lies in an end bin that holds clamped (out-of-range) tokens: the
        histogram does not know where inside (or beyond) that bin their ratios are."""
        i = self.bin_of(log_r)
        return (i == 0 and self.scalar("below_range") > 0) or (
            i == self.num_bins - 1 and self.scalar("above_range") > 0)

    def add(
        self,
        ratio_fp8: torch.Tensor,
        ratio_ref: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
        dual_clip: float | None = None,
    ) -> None:
        """Accumulate one micro-batch.

        Args:
            ratio_fp8: [B, T] float, pi_theta / pi_old under the FP8 trainer (any shape, all equal).
            ratio_ref: [B, T] float, the same ratio from the BF16 shadow forward.
            advantages: [B, T] float, per token. mask: [B, T] bool/0-1 response mask.
            weights: [B, T] the per-token factor the loss applies (TIS / IcePop weight times the
                sequence-aggregation weight, algo.policy_loss.loss_token_weights); None = 1.
            dual_clip: the dual-clip c, or None. A < 0 tokens with r > c are held at -c A by the
                loss (zero gradient, never lower-clipped): they are left out of that ratio's sums.
        """
        if self.reduced:
            raise RuntimeError("RatioHistogram.add after reduce(): start a new histogram per calibration")
        weights = torch.ones_like(ratio_fp8) if weights is None else weights
        for name, t in (("ratio_ref", ratio_ref), ("advantages", advantages), ("mask", mask), ("weights", weights)):
            if t.shape != ratio_fp8.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(ratio_fp8.shape)} like ratio_fp8")
        r8, rr, adv, w = (t.detach().reshape(-1).double() for t in (ratio_fp8, ratio_ref, advantages, weights))
        valid = mask.detach().reshape(-1).bool()
        finite = torch.isfinite(r8) & torch.isfinite(rr) & torch.isfinite(adv) & torch.isfinite(w)
        finite &= (r8 >= 0) & (rr >= 0) & (w >= 0)
        keep = valid & finite
        self._add_scalar("nonfinite", (valid & ~finite).sum())
        self._add_scalar("tokens", keep.sum())
        r8, rr, adv, w = r8[keep], rr[keep], adv[keep], w[keep]
        c = math.inf if dual_clip is None else float(dual_clip)
        self._add_fp8_side(r8, rr, adv, w * ~((adv < 0) & (r8 > c)))
        self._add_ref_side(rr, adv, w * ~((adv < 0) & (rr > c)))

    def add_sequences(
        self,
        log_ratio_fp8: torch.Tensor,
        log_ratio_ref: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
        dual_clip: float | None = None,
    ) -> None:
        """Accumulate one micro-batch at the sequence level (GSPO): one entry per sequence.

        The entry of sequence i is its ratio s_i = exp(mean_t log r_t) under FP8 and under the BF16
        shadow, its advantage (the mean over its tokens: GRPO's one advantage per sequence) and its
        loss weight, the sum of its tokens' weights (the loss's total factor on -A f(s_i)). From
        there the histogram and every rule are the token-level ones, counted in sequences.

        Args:
            log_ratio_fp8, log_ratio_ref: [B, T] float token log-ratios (FP8 trainer, BF16 shadow).
            advantages, mask, weights: [B, T] as in `add` (weights: loss_token_weights; None = 1).
        """
        valid = mask.detach().bool()
        weights = torch.ones_like(log_ratio_fp8) if weights is None else weights
        log8, log_ref, adv = (sequence_mean(t.detach().double(), valid)
                              for t in (log_ratio_fp8, log_ratio_ref, advantages))
        log8, log_ref = log8.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), log_ref.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        w = torch.where(valid, weights.detach().double(), 0.0).sum(dim=-1, keepdim=True)
        self.add(log8.exp(), log_ref.exp(), adv, valid.any(dim=-1, keepdim=True), weights=w, dual_clip=dual_clip)

    def _add_fp8_side(self, r8: torch.Tensor, rr: torch.Tensor, adv: torch.Tensor, w: torch.Tensor) -> None:
        neg, pos = (adv < 0) & (w > 0), (adv > 0) & (w > 0)
        log8 = torch.log(r8)  # log(0) = -inf is clamped into the first bin below
        idx = ((log8.clamp(-self.log_ratio_range, self.log_ratio_range) - self.lower_edge) / self.bin_width).floor()
        idx = idx.long().clamp(0, self.num_bins - 1)
        per_balance = {"count": w, "abs_adv": w * adv.abs(), "abs_adv_ratio": w * adv.abs() * r8}
        for side, sel in (("neg", neg), ("pos", pos)):
            for balance, value in per_balance.items():
                self._add_histogram(f"{side}_{balance}", idx[sel], value[sel])
        self._add_histogram("neg_ref_kept", idx[neg & (rr >= 1.0 - self.eps_low)], w[neg & (rr >= 1.0 - self.eps_low)])
        self._add_histogram("pos_ref_clipped", idx[pos & (rr > 1.0 + self.eps_high)], w[pos & (rr > 1.0 + self.eps_high)])
        sums = {"neg_tokens": neg.sum(), "pos_tokens": pos.sum(), "neg": w[neg].sum(), "pos": w[pos].sum(),
                "below_range": ((neg | pos) & (log8 < self.lower_edge)).sum(),
                "above_range": ((neg | pos) & (log8 > self.log_ratio_range)).sum()}
        for name, value in sums.items():
            self._add_scalar(name, value)

    def _add_ref_side(self, rr: torch.Tensor, adv: torch.Tensor, w: torch.Tensor) -> None:
        neg, pos = (adv < 0) & (w > 0), (adv > 0) & (w > 0)
        neg_kept, pos_kept = neg & (rr >= 1.0 - self.eps_low), pos & (rr <= 1.0 + self.eps_high)
        per_balance = {"count": w, "abs_adv": w * adv.abs(), "abs_adv_ratio": w * adv.abs() * rr}
        for balance, value in per_balance.items():
            self._add_scalar(f"neg_mass_ref_{balance}", value[neg_kept].sum())
            self._add_scalar(f"pos_mass_ref_{balance}", value[pos_kept].sum())
        self._add_scalar("neg_ref", w[neg].sum())
        self._add_scalar("neg_clip_ref", w[neg & ~neg_kept].sum())
        self._add_scalar("pos_clip_ref", w[pos & (rr > 1.0 + self.eps_high)].sum())

    def _add_histogram(self, name: str, idx: torch.Tensor, values: torch.Tensor) -> None:
        self.histogram(name).add_(torch.bincount(idx, weights=values, minlength=self.num_bins))

    def _add_scalar(self, name: str, value: torch.Tensor | float) -> None:
        self.payload[len(HISTOGRAMS) * self.num_bins + SCALARS.index(name)] += float(value)

    def reduce(self, reduce: Reducer | None = None) -> None:
        """Sum the payload across ranks with ONE call of `reduce` (in-place all_reduce on the DP group)."""
        if self.reduced:
            raise RuntimeError("RatioHistogram.reduce called twice: the payload would be summed twice")
        self.payload = (reduce or identity_reduce)(self.payload)
        self.reduced = True

    def merge(self, payload: torch.Tensor) -> None:
        """Add another histogram's (unreduced) payload of the same layout, e.g. one per micro-batch."""
        if self.reduced:
            raise RuntimeError("RatioHistogram.merge after reduce()")
        if payload.shape != self.payload.shape:
            raise ValueError(f"payload has shape {tuple(payload.shape)}, expected {tuple(self.payload.shape)}")
        self.payload += payload.double()

    def payload_bytes(self) -> int:
        """Bytes moved by the all-reduce (independent of the number of tokens)."""
        return self.payload.numel() * self.payload.element_size()

    def cumulative(self, name: str, log_r: float) -> float:
        """Sum of histogram `name` below log r, the bin holding log r split uniformly."""
        return cumulative_below(self.histogram(name), log_r, self.lower_edge, self.bin_width)

    def above(self, name: str, log_r: float) -> float:
        """Sum of histogram `name` at or above log r."""
        return float(self.histogram(name).sum()) - self.cumulative(name, log_r)


def cumulative_below(hist: torch.Tensor, log_value: float, lower_edge: float, bin_width: float) -> float:
    """C(x): the sum of `hist` below log r = x, uniform within each bin; piecewise linear, non-decreasing."""
    if math.isinf(log_value):
        return 0.0 if log_value < 0 else float(hist.sum())
    pos = (log_value - lower_edge) / bin_width
    i = min(max(int(math.floor(pos)), 0), hist.numel() - 1)
    frac = min(max(pos - i, 0.0), 1.0)
    return float(hist[:i].sum()) + float(hist[i]) * frac


def solution_interval(hist: torch.Tensor, low_target: float, high_target: float, lower_edge: float,
                      bin_width: float) -> tuple[float, float] | None:
    """The interval [a, b] of log r where low_target <= C(x) <= high_target (C: cumulative_below).

    C is non-decreasing, so the set is an interval: a is the smallest x reaching low_target (-inf
    when low_target <= 0), b the largest x not exceeding high_target (+inf when high_target is at
    least the total). Flat stretches of C (empty bins) are part of it: an empirical quantile is an
    interval between order statistics. None when low_target exceeds the total (not attainable).
    """
    cum = hist.cumsum(0)
    total = float(cum[-1])
    slack = 1e-12 * max(abs(total), 1.0)  # float64 round-off of a weighted cumsum vs a target built from sums
    if low_target > total + slack:
        return None
    return (_first_reaching(hist, cum, low_target - slack, lower_edge, bin_width),
            _last_within(hist, cum, high_target + slack, lower_edge, bin_width))


def _first_reaching(hist, cum, target: float, lower_edge: float, bin_width: float) -> float:
    if target <= 0.0:
        return -math.inf
    i = min(int(torch.searchsorted(cum, torch.tensor([target], dtype=cum.dtype))), hist.numel() - 1)
    before = float(cum[i - 1]) if i > 0 else 0.0
    frac = min(max((target - before) / float(hist[i]), 0.0), 1.0) if float(hist[i]) > 0 else 1.0
    return lower_edge + (i + frac) * bin_width


def _last_within(hist, cum, target: float, lower_edge: float, bin_width: float) -> float:
    if target >= float(cum[-1]):
        return math.inf
    i = int(torch.searchsorted(cum, torch.tensor([target], dtype=cum.dtype), right=True))  # cum[i] > target
    before = float(cum[i - 1]) if i > 0 else 0.0
    frac = min(max((target - before) / float(hist[i]), 0.0), 1.0)
    return lower_edge + (i + frac) * bin_width
