"""Per-token policy-gradient surrogates: the clipped-surrogate primitive and the loss modes built on it.

Shapes: B = sequences, T = padded response length; every tensor [B, T] float, already zeroed on
padding by the caller (policy_loss). A loss mode maps (logprobs, log_ratio, advantages, valid,
bounds) to a Surrogate: the per-token loss, the masks of tokens whose gradient a clip zeroes,
the log-ratio the clip acted on (for metrics) and its own metrics. Aggregation, rollout
correction and penalties are policy_loss's, the same for every mode.

  vanilla     max(-A r, -A clip(r, L, H)) [dual-clip min(., -c A) for A < 0]    (PPO / GRPO / DAPO)
  gspo        the same on s_i = exp(mean_t log r_i,t), gradient through the mean (GSPO, 2507.18071)
  gspo_token  the same on s_i,t = sg[s_i] pi_t / sg[pi_t]: value s_i, gradient s_i dlog pi_t
  cispo       -sg(clip(r, L, H)) A log pi                                       (MiniMax-M1, 2506.13585)
  reinforce   -A log pi, no ratio                        (NeMo-RL disable_ppo_ratio; ratio-free REINFORCE)
  dro         -(A log pi - beta / 2 (log pi - log pi_old)^2)    (Tinker `dro`; Richemond et al. 2024)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_rl.algo.metrics import Metrics, masked_metric, mean_and_square

# exp(20) ~ 5e8: far outside any trust region, still finite in float32 (as verl).
LOG_RATIO_CLAMP = 20.0

LOSS_MODES = ("vanilla", "gspo", "gspo_token", "cispo", "reinforce", "dro")
SEQUENCE_RATIO_MODES = ("gspo", "gspo_token")
# Modes with a clip of the ratio that zeroes gradients (dual-clip and Calibrated Clipping apply).
CLIPPED_MODES = ("vanilla", "gspo", "gspo_token")


class ClipMasks(NamedTuple):
    """Boolean [B, T] masks of tokens whose gradient the clip zeroes, by cause."""

    low: torch.Tensor  # A < 0 and r < L
    high: torch.Tensor  # A > 0 and r > H
    dual: torch.Tensor  # A < 0 and the dual-clip bound -c A binds


class Surrogate(NamedTuple):
    loss: torch.Tensor  # [B, T] per-token policy loss, not yet masked, weighted or aggregated
    clips: ClipMasks
    log_ratio: torch.Tensor  # [B, T] detached log-ratio the clip acted on (token or broadcast sequence)
    metrics: Metrics


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, ClipMasks]:
    """The one clipped-surrogate primitive: per-token loss -A * f(r) and the binding-clip masks.

    f(r) = L where (A < 0, r < L), H where (A > 0, r > H), c where dual-clip binds (A < 0, f > c),
    else r. This equals max(-A r, -A clip(r, L, H)) [then min(., -c A) for A < 0] in value, and
    selects branches with torch.where, so the gradient is exactly -A r dlogp unclipped and exactly 0
    clipped (torch.maximum would split the gradient of ties).

    Args:
        log_ratio: [B, T] float, logprobs - old_logprobs (carries grad).
        advantages: [B, T] float, per token.
        clip_low, clip_high: ratio bounds L < H.
        eps_clip_c: dual-clip constant c > 1, or None.

    Returns:
        per-token loss [B, T] (not masked) and ClipMasks.
    """
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    neg, pos = advantages < 0, advantages > 0
    low = neg & (ratio < clip_low)
    high = pos & (ratio > clip_high)
    factor = torch.where(low, clip_low, torch.where(high, clip_high, ratio))
    dual = torch.zeros_like(low)
    if eps_clip_c is not None:
        dual = neg & (factor > eps_clip_c)
        factor = torch.where(dual, eps_clip_c, factor)
    return -advantages * factor, ClipMasks(low, high, dual)


def sequence_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over the valid tokens, [B, T] -> [B, 1] (0 for a sequence with none)."""
    values = torch.where(valid, values, 0.0)
    return values.sum(dim=-1, keepdim=True) / valid.sum(dim=-1, keepdim=True).clamp(min=1)


def _no_clips(like: torch.Tensor) -> ClipMasks:
    none = torch.zeros_like(like, dtype=torch.bool)
    return ClipMasks(none, none, none)


def vanilla(logprobs, log_ratio, advantages, valid, clip_low, clip_high, eps_clip_c=None, **_) -> Surrogate:
    """PPO's token-level clipped surrogate."""
    loss, clips = clipped_surrogate(log_ratio, advantages, clip_low, clip_high, eps_clip_c)
    return Surrogate(loss, clips, log_ratio.detach(), {})


def _sequence_metrics(seq_log_ratio: torch.Tensor, valid: torch.Tensor) -> Metrics:
    """seq_log_ratio/mean, /std over sequences (not tokens) holding a valid token."""
    return mean_and_square("seq_log_ratio", seq_log_ratio.detach().reshape(-1), valid.any(dim=-1))


def gspo(logprobs, log_ratio, advantages, valid, clip_low, clip_high, eps_clip_c=None, **_) -> Surrogate:
    """GSPO: the primitive on the sequence ratio s_i = exp(mean_t log r_i,t), clipped per sequence.

    Gradient through the mean: d s_i / d log pi_t = s_i / |o_i|, so under seq-mean-token-mean the
    sequence's loss is -A_i f(s_i) exactly as in the paper's eq. 5.
    """
    seq = sequence_mean(log_ratio, valid)
    seq_tok = seq.expand_as(log_ratio)
    loss, clips = clipped_surrogate(seq_tok, advantages, clip_low, clip_high, eps_clip_c)
    return Surrogate(loss, clips, seq_tok.detach(), _sequence_metrics(seq, valid))


def gspo_token(logprobs, log_ratio, advantages, valid, clip_low, clip_high, eps_clip_c=None, **_) -> Surrogate:
    """GSPO-token: log s_i,t = sg[log s_i] + log pi_t - sg[log pi_t]; value s_i, token-level gradient.

    With one advantage per sequence it has GSPO's gradient (paper eq. 14-15); it differs only
    where the advantage varies along the sequence. verl's `loss_mode: gspo` is this form.
    """
    seq = sequence_mean(log_ratio, valid).detach()
    seq_tok = seq + (logprobs - logprobs.detach())
    loss, clips = clipped_surrogate(seq_tok, advantages, clip_low, clip_high, eps_clip_c)
    return Surrogate(loss, clips, seq_tok.detach(), _sequence_metrics(seq, valid))


def cispo(logprobs, log_ratio, advantages, valid, clip_low, clip_high, **_) -> Surrogate:
    """CISPO: the ratio is clipped under stop-gradient and weighs -A log pi; no token loses its gradient.

    cispo_clipfrac: valid tokens whose weight the clip changed (slime's / verl's pg_clipfrac of
    CISPO); pg_clipfrac stays the zero-gradient fraction, 0 here.
    """
    ratio = torch.exp(log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(clip_low, clip_high)
    loss = -weight * advantages * logprobs
    metrics = {"cispo_clipfrac": masked_metric((weight != ratio).double(), valid)}
    return Surrogate(loss, _no_clips(valid), log_ratio.detach(), metrics)


def reinforce(logprobs, log_ratio, advantages, valid, **_) -> Surrogate:
    """Ratio-free REINFORCE: -A log pi (gradient -A per token; old log-probs only feed metrics)."""
    return Surrogate(-advantages * logprobs, _no_clips(valid), log_ratio.detach(), {})


def dro(logprobs, log_ratio, advantages, valid, dro_beta=1.0, **_) -> Surrogate:
    """DRO: -(A log pi - beta / 2 (log pi - log pi_old)^2), the quadratic penalty keeping pi near
    the sampler (old log-probs). Gradient -A + beta (log pi - log pi_old)."""
    loss = -(advantages * logprobs - 0.5 * dro_beta * log_ratio.square())
    return Surrogate(loss, _no_clips(valid), log_ratio.detach(), {})


_SURROGATES = {"vanilla": vanilla, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo,
               "reinforce": reinforce, "dro": dro}


def surrogate(loss_mode: str, **kwargs) -> Surrogate:
    """The Surrogate of `loss_mode` (one of LOSS_MODES); kwargs as the modes above take them."""
    if loss_mode not in _SURROGATES:
        raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {loss_mode!r}")
    return _SURROGATES[loss_mode](**kwargs)
