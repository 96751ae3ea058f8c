"""Rollout-vs-trainer correction: TIS (truncate) and MIS/IcePop (mask) weights, mismatch metrics."""

from __future__ import annotations

import torch

from megatron_rl.algo.kl import K3_LOG_RATIO_CLAMP
from megatron_rl.algo.metrics import Metrics, masked_metric, mean_and_square

TIS_MODES = ("truncate", "icepop")


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
) -> tuple[torch.Tensor, Metrics]:
    """Token-level importance weights w = pi_old / pi_rollout, detached, to multiply the policy loss.

    "truncate" (TIS): w clamped to [tis_clip_low, tis_clip] (slime clamps both ends; the default
    lower cap 0 is verl's upper-only truncation). "icepop" (MIS): w kept where
    icepop_low <= w <= icepop_high (inclusive), else 0; masked tokens stay in the loss denominator.

    Args:
        old_logprobs, rollout_logprobs: [B, T] float (trainer at theta_old; rollout engine).
        valid: [B, T] bool response mask.

    Returns:
        weights [B, T] float32 (1 at invalid positions) and metrics: tis_clipfrac, the fraction of
        valid tokens whose weight was changed (truncated or masked).
    """
    check_correction_args(mode, tis_clip, tis_clip_low, icepop_low, icepop_high)
    log_w = torch.where(valid, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)
    raw = torch.exp(log_w.float().clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP))
    if mode == "truncate":
        applied = raw.clamp(tis_clip_low, tis_clip)
        changed = applied != raw
    else:
        keep = (raw >= icepop_low) & (raw <= icepop_high)
        applied = torch.where(keep, raw, 0.0)
        changed = ~keep
    return applied, {"tis_clipfrac": masked_metric(changed.double(), valid)}


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
