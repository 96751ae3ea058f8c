"""Rollout-vs-trainer correction: TIS (truncate) and MIS/IcePop (mask) weights, token or sequence level,
the rejection-sampling mask (verl's rollout_rs token_k1), mismatch metrics."""

from __future__ import annotations

import math

import torch

from megatron_rl.algo.kl import K3_LOG_RATIO_CLAMP
from megatron_rl.algo.metrics import Metrics, masked_metric, mean_and_square

TIS_MODES = ("truncate", "icepop")
# token: w_t = exp(d_t); sequence: w_i = exp(sum_t d_t) (verl rollout_is=sequence, NeMo-RL
# sequence_level_importance_ratios); geo_mean: w_i = exp(mean_t d_t). d = log pi_old - log pi_rollout.
TIS_LEVELS = ("token", "sequence", "geo_mean")
ROLLOUT_RS_MODES = ("", "token_k1")


def check_correction_args(
    mode: str, tis_clip: float, tis_clip_low: float, icepop_low: float, icepop_high: float
) -> None:
    """Raise ValueError naming the bad knob."""
    if mode not in TIS_MODES:
        raise ValueError(f"tis_mode must be one of {TIS_MODES}, got {mode!r}")
    if mode == "truncate" and not 0.0 <= tis_clip_low < tis_clip:
        raise ValueError(f"need 0 <= tis_clip_low < tis_clip, got tis_clip_low={tis_clip_low}, tis_clip={tis_clip}")
    if mode == "icepop" and not 0.0 <= icepop_low < icepop_high:
        raise ValueError(f"need 0 <= icepop_low < icepop_high, got icepop_low={icepop_low}, icepop_high={icepop_high}")


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    valid: torch.Tensor,
    *,
    mode: str = "truncate",
    tis_clip: float = 2.0,
    tis_clip_low: float = 0.0,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    level: str = "token",
) -> tuple[torch.Tensor, Metrics]:
    """Importance weights w = pi_old / pi_rollout, detached, to multiply the policy loss.

    "truncate" (TIS): w clamped to [tis_clip_low, tis_clip] (slime clamps both ends; the default
    lower cap 0 is verl's upper-only truncation). "icepop" (MIS): w kept where
    icepop_low <= w <= icepop_high (inclusive), else 0; masked tokens stay in the loss denominator.
    `level` (TIS_LEVELS): per token, or one weight per sequence, exp of the sum (the sequence
    likelihood ratio) or the mean (geometric mean) of the token log-weights over `valid`,
    broadcast over the sequence; the log-weight is clamped to +-20 before exp (as verl).

    Args:
        old_logprobs, rollout_logprobs: [B, T] float (trainer at theta_old; rollout engine).
        valid: [B, T] bool response mask (pre-rejection: the sequence weight spans every response token).

    Returns:
        weights [B, T] float32 (1 at invalid positions) and metrics: tis_clipfrac, the fraction of
        valid tokens whose weight was changed (truncated or masked).
    """
    check_correction_args(mode, tis_clip, tis_clip_low, icepop_low, icepop_high)
    if level not in TIS_LEVELS:
        raise ValueError(f"tis_level must be one of {TIS_LEVELS}, got {level!r}")
    log_w = torch.where(valid, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)
    if level != "token":
        log_w = log_w.sum(dim=-1, keepdim=True)
        if level == "geo_mean":
            log_w = log_w / valid.sum(dim=-1, keepdim=True).clamp(min=1)
        log_w = log_w.expand_as(valid)
    raw = torch.exp(log_w.float().clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP))
    if mode == "truncate":
        applied = raw.clamp(tis_clip_low, tis_clip)
        changed = applied != raw
    else:
        keep = (raw >= icepop_low) & (raw <= icepop_high)
        applied = torch.where(keep, raw, 0.0)
        changed = ~keep
    return applied, {"tis_clipfrac": masked_metric(changed.double(), valid)}


def rejection_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    valid: torch.Tensor,
    rollout_rs: str = "token_k1",
    threshold: float = 2.0,
    threshold_low: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """verl's rollout rejection sampling, `rollout_rs: token_k1`: the tokens it rejects leave the mask.

    k1 = log pi_rollout - log pi_old per token (verl's token_k1, the k1 estimate of
    KL(pi_rollout || pi_old) at a rollout-sampled token; log-ratio clamped to +-20). A token is
    kept where log(threshold_low) <= k1 <= log(threshold), inclusive; threshold_low defaults to
    1 / threshold (verl's "low_high" threshold string, or one value u meaning 1/u .. u).

    Args:
        old_logprobs, rollout_logprobs: [B, T] float; valid: [B, T] bool response mask.

    Returns:
        kept [B, T] bool (a subset of valid) and metrics: rollout_rs_masked_fraction, the share of
        valid tokens rejected.
    """
    if rollout_rs != "token_k1":
        raise ValueError(f"rollout_rs must be one of {ROLLOUT_RS_MODES[1:]} here, got {rollout_rs!r}")
    low = 1.0 / threshold if threshold_low is None else threshold_low
    if not 0.0 < low <= threshold:
        raise ValueError(f"need 0 < rollout_rs_threshold_low <= rollout_rs_threshold, got {low}, {threshold}")
    d = old_logprobs.detach().double() - rollout_logprobs.detach().double()
    d = d.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    k1 = torch.where(valid, -d, 0.0)
    kept = valid & (k1 >= math.log(low)) & (k1 <= math.log(threshold))
    return kept, {"rollout_rs_masked_fraction": masked_metric((valid & ~kept).double(), valid)}


def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, valid: torch.Tensor) -> Metrics:
    """Trainer-vs-rollout disagreement on the sampled tokens, over the given (pre-rejection) mask.

    d = log pi_old - log pi_rollout per token:
      mismatch/abs_logprob_diff        mean |d|
      mismatch/token_mult_prob_error   mean exp(|d|)  (NeMo-RL; 1.0 = identical)
      mismatch/k3_kl                   mean exp(d) - 1 - d, estimates KL(pi_rollout || pi_old)
      is_weight/mean, is_weight/mean_sq of the raw weight exp(d); reduce_metrics derives
      is_weight/std and `ess` = E[w]^2 / E[w^2] (normalised effective sample size, 1 = no mismatch)

    Args:
        old_logprobs, rollout_logprobs: [B, T] float; valid: [B, T] bool.
    """
    d = torch.where(valid, old_logprobs.detach().double() - rollout_logprobs.detach().double(), 0.0)
    d_clamped = d.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return {
        "mismatch/abs_logprob_diff": masked_metric(d.abs(), valid),
        "mismatch/token_mult_prob_error": masked_metric(torch.exp(d_clamped.abs()), valid),
        "mismatch/k3_kl": masked_metric(torch.expm1(d_clamped) - d_clamped, valid),
        **mean_and_square("is_weight", torch.exp(d_clamped), valid),
    }
