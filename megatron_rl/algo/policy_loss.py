"""Policy loss (PPO/GRPO/DAPO, GSPO, CISPO, REINFORCE, DRO; dual-clip, TIS/IcePop, rejection, KL, entropy).

Shapes: B = sequences in the micro-batch, T = padded response length. All per-token inputs are
[B, T] float with `mask` [B, T] (1 = response token). Semantics chosen among the peer frameworks
(docs/algo.md explains each choice):
  ratio      r = exp(logprobs - old_logprobs), log-ratio clamped to +-20 before exp (zero gradient
             beyond; keeps A = 0 tokens from making NaN); masked positions are zeroed with
             torch.where, so padding holding NaN or garbage cannot leak in.
  loss       max(-A r, -A clip(r, L, H)), and for A < 0 with dual-clip min(that, -c A); the other
             loss modes (surrogates.py) replace this per-token term, nothing else.
  clipped    a token counts as clipped only when the clipped branch binds strictly (ties and A = 0
             are not clipped); a clipped token has exactly zero gradient.
  aggregate  sum over this micro-batch divided by the GLOBAL `denominator` (loss_denominator), so
             the sum of the returned losses over micro-batches and DP ranks is the loss of the whole
             batch. DDP that averages gradients over ranks needs the loss scaled by dp_size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.algo.kl import kl_estimate
from megatron_rl.algo.loss_spec import LOSS_AGG_MODES, LossSpec
from megatron_rl.algo.metrics import Metrics, Reducer, identity_reduce, masked_metric, mean_and_square, metric
from megatron_rl.algo.rollout_correction import (
    importance_weights,
    mismatch_metrics,
    rejection_mask,
)
from megatron_rl.algo.surrogates import (  # noqa: F401 (LOG_RATIO_CLAMP: public here too)
    LOG_RATIO_CLAMP,
    SEQUENCE_RATIO_MODES,
    ClipMasks,
    Surrogate,
    sequence_mean,
    surrogate,
)


def bounds_from_eps(eps_clip: float = 0.2, eps_clip_high: float | None = None) -> tuple[float, float]:
    """Ratio bounds (L, H) = (1 - eps_clip, 1 + eps_clip_high), eps_clip_high defaulting to eps_clip.

    GRPO: eps 0.2 / 0.2; DAPO clip-higher: 0.2 / 0.28; GSPO: 3e-4 / 4e-4 (on sequence ratios).
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if not 0.0 <= eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in [0, 1), got {eps_clip}")
    if high < 0.0:
        raise ValueError(f"eps_clip_high must be >= 0, got {high}")
    return 1.0 - eps_clip, 1.0 + high


def _local_count(valid: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Local share of the denominator: valid tokens, or sequences holding at least one valid token."""
    if loss_agg_mode == "token-mean":
        return valid.sum()
    return (valid.sum(dim=-1) > 0).sum()


def aggregate(values: torch.Tensor, valid: torch.Tensor, loss_agg_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator of the aggregated loss and this micro-batch's share of the denominator.

    token-mean:           sum_bt v                      / total valid tokens
    seq-mean-token-mean:  sum_b (sum_t v / n_b)         / total non-empty sequences
    seq-mean-token-sum:   sum_b sum_t v                 / total non-empty sequences
    Fully masked rows are left out of the sequence count (as verl; slime and NeMo-RL count them).

    Args:
        values: [B, T] float; valid: [B, T] bool.

    Returns:
        (numerator scalar with grad, local count scalar long).
    """
    values = torch.where(valid, values, 0.0)
    if loss_agg_mode == "token-mean":
        numerator = values.sum()
    elif loss_agg_mode == "seq-mean-token-mean":
        numerator = (values.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)).sum()
    elif loss_agg_mode == "seq-mean-token-sum":
        numerator = values.sum()
    else:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    return numerator, _local_count(valid, loss_agg_mode)


def loss_denominator(
    mask: torch.Tensor | Sequence[torch.Tensor],
    loss_agg_mode: str = "token-mean",
    reduce: Reducer | None = None,
) -> float:
    """The global denominator for `policy_loss`: counted over all micro-batches, summed over DP.

    Args:
        mask: [B, T] response mask, or a sequence of them (this rank's micro-batches of the step).
        loss_agg_mode: see `aggregate`.
        reduce: sums a float tensor across DP ranks in place (all_reduce on the DP group); called once.

    Returns:
        total valid tokens (token-mean) or non-empty sequences (seq-mean-*), at least 1: an all-masked
        global batch then gives loss 0 and zero gradient instead of 0 / 0.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    masks = [mask] if isinstance(mask, torch.Tensor) else list(mask)
    local = torch.zeros(1, dtype=torch.float64)
    for m in masks:
        local += _local_count(m.bool(), loss_agg_mode).double()
    total = (reduce or identity_reduce)(local)
    return max(float(total.item()), 1.0)


def _check_denominator(denominator: float) -> None:
    if not float(denominator) > 0.0:
        raise ValueError(f"denominator must be > 0, got {denominator}")


def _check_tensors(logprobs: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logprobs.shape)} like logprobs")


def _check_needs(
    use_tis: bool,
    rollout_logprobs: torch.Tensor | None,
    kl_loss_coef: float,
    ref_logprobs: torch.Tensor | None,
    entropy_coef: float,
    entropy: torch.Tensor | None,
    rollout_rs: str = "",
) -> None:
    if use_tis and rollout_logprobs is None:
        raise ValueError("use_tis=True needs rollout_logprobs")
    if rollout_rs and rollout_logprobs is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_logprobs")
    if kl_loss_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_loss_coef={kl_loss_coef} needs ref_logprobs")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy")


def clip_metrics(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clips: ClipMasks,
    valid: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: bool = False,
) -> Metrics:
    """Clip fractions by side and advantage sign; each over the tokens of that advantage sign.

    clip/low_neg and clip/high_pos (and clip/dual) are the binding clips (zero gradient);
    clip/low_pos and clip/high_neg count tokens outside [L, H] on the side the clip does not bind
    (they keep their gradient). pg_clipfrac is every zero-gradient token over all valid tokens.
    """
    neg, pos = valid & (advantages < 0), valid & (advantages > 0)
    clipped = (clips.low | clips.high | clips.dual) & valid
    out = {
        "clip/low_neg": metric((clips.low & valid).sum(), neg.sum()),
        "clip/high_pos": metric((clips.high & valid).sum(), pos.sum()),
        "clip/low_pos": metric((pos & (ratio < clip_low)).sum(), pos.sum()),
        "clip/high_neg": metric((neg & (ratio > clip_high)).sum(), neg.sum()),
        "pg_clipfrac": metric(clipped.sum(), valid.sum()),
    }
    if dual_clip:
        out["clip/dual"] = metric((clips.dual & valid).sum(), neg.sum())
    return out


def reference_clip_metrics(
    ratio: torch.Tensor,
    ratio_ref: torch.Tensor,
    advantages: torch.Tensor,
    clips: ClipMasks,
    valid: torch.Tensor,
    ref_low: float,
    ref_high: float,
) -> Metrics:
    """Clip decisions against a high-precision (BF16) reference ratio of the same tokens.

    false_clip/low_neg   P(r < L and r_ref >= ref_low | A < 0): gradient wrongly zeroed (paper 1.3)
    missed_clip/low_neg  P(r >= L and r_ref < ref_low | A < 0): the converse
    false_clip/share     false lower clips / all lower clips of A < 0 tokens
    false_clip/high_pos, missed_clip/high_pos: the same on the upper side for A > 0 tokens
    clip/low_neg_ref, clip/high_pos_ref: the reference's own clip fractions; log_ratio_ref/*.
    """
    ratio_ref = ratio_ref.detach().to(ratio.dtype)
    neg, pos = valid & (advantages < 0), valid & (advantages > 0)
    ref_low_clip, ref_high_clip = neg & (ratio_ref < ref_low), pos & (ratio_ref > ref_high)
    low, high = clips.low & valid, clips.high & valid
    false_low = low & ~ref_low_clip
    out = {
        "false_clip/low_neg": metric(false_low.sum(), neg.sum()),
        "missed_clip/low_neg": metric((ref_low_clip & ~low).sum(), neg.sum()),
        "false_clip/share": metric(false_low.sum(), low.sum()),
        "false_clip/high_pos": metric((high & ~ref_high_clip).sum(), pos.sum()),
        "missed_clip/high_pos": metric((ref_high_clip & ~high).sum(), pos.sum()),
        "clip/low_neg_ref": metric(ref_low_clip.sum(), neg.sum()),
        "clip/high_pos_ref": metric(ref_high_clip.sum(), pos.sum()),
    }
    out.update(mean_and_square("log_ratio_ref", torch.log(torch.where(valid, ratio_ref, 1.0)), valid))
    return out


def _penalties(
    logprobs: torch.Tensor,
    valid: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    kl_loss_type: str,
    kl_loss_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
) -> tuple[torch.Tensor | float, Metrics]:
    """Per-token kl_loss_coef * KL - entropy_coef * entropy; logs kl_loss / entropy when given."""
    total: torch.Tensor | float = 0.0
    metrics: Metrics = {}
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, torch.where(valid, ref_logprobs.detach().float(), 0.0), kl_loss_type)
        metrics["kl_loss"] = masked_metric(kl, valid)
        if kl_loss_coef != 0.0:
            total = total + kl_loss_coef * kl
    if entropy is not None:
        ent = torch.where(valid, entropy.float(), 0.0)
        metrics["entropy"] = masked_metric(ent, valid)
        if entropy_coef != 0.0:
            total = total - entropy_coef * ent
    return total, metrics


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
    *,
    denominator: float,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ratio_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Policy loss of one micro-batch: this shard's additive share of the global-batch loss.

    loss = [sum over tokens/sequences of w * surrogate + kl_loss_coef * KL - entropy_coef * H] / denominator

    Args:
        logprobs: [B, T] float, current policy (carries grad).
        old_logprobs: [B, T] float, policy at theta_old (trainer recompute, or rollout); detached.
            Ignored (may be None) with spec.force_on_policy_ratio: `logprobs.detach()` stands in.
        advantages: [B, T] float, per token (GRPO broadcasts the sequence advantage).
        mask: [B, T] bool/0-1, response tokens.
        spec: the knobs (loss_spec.LossSpec): ratio bounds (L, H) (bounds_from_eps(eps_clip,
            eps_clip_high) or the CalibratedClipController's), dual-clip, aggregation, loss mode, rollout
            correction (TIS / IcePop, token or sequence weights), rejection (verl's token_k1), KL and
            entropy coefficients, the reference ratio's bounds.
        denominator: global normaliser from `loss_denominator` (same agg mode, all micro-batches, DP;
            with rollout_rs, counted on the kept tokens: `loss_mask`).
        rollout_logprobs: [B, T] rollout-engine logprobs; enables mismatch/* metrics (over `mask`,
            the pre-rejection mask, so rejection cannot hide mismatch), TIS/IcePop and rollout_rs.
        ref_logprobs: [B, T] reference policy, for the KL penalty (kl_loss_type: k1/k2/k3).
        entropy: [B, T] per-token entropy (with grad), for the bonus.
        ratio_ref: [B, T] high-precision (BF16 shadow) token ratio of the same tokens, for false-clip
            metrics (made a sequence ratio under the sequence loss modes), at spec.ref_clip_low/high.

    Returns:
        (loss scalar with grad, metrics: dict of float64 [2] (numerator, denominator); reduce
        with metrics.reduce_metrics). `loss` and `pg_loss` reduce to the global-batch loss.
    """
    s = spec
    if s.force_on_policy_ratio:
        old_logprobs = logprobs.detach()
    elif old_logprobs is None:
        raise ValueError("old_logprobs is None: only force_on_policy_ratio runs without them")
    _check_denominator(denominator)
    _check_tensors(logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask, entropy=entropy,
                   rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, ratio_ref=ratio_ref)
    _check_needs(s.use_tis, rollout_logprobs, s.kl_loss_coef, ref_logprobs, s.entropy_coef, entropy, s.rollout_rs)

    response = mask.bool()
    metrics: Metrics = {}
    valid = response
    if s.rollout_rs:
        valid, rs_metrics = rejection_mask(old_logprobs, rollout_logprobs, response, s.rollout_rs,
                                           s.rollout_rs_threshold, s.rollout_rs_threshold_low)
        metrics.update(rs_metrics)
    raw_log_ratio = logprobs.float() - old_logprobs.detach().float()
    log_ratio = torch.where(valid, raw_log_ratio, 0.0)
    adv = torch.where(valid, advantages.detach().float(), 0.0)
    logprobs = torch.where(valid, logprobs.float(), 0.0)
    sur = surrogate(s.loss_mode, logprobs=logprobs, log_ratio=log_ratio, advantages=adv, valid=valid,
                    clip_low=s.clip_low, clip_high=s.clip_high, eps_clip_c=s.eps_clip_c, dro_beta=s.dro_beta)
    pg_tok = sur.loss
    metrics.update(sur.metrics)

    metrics["nonfinite_logprobs"] = metric((response & ~torch.isfinite(raw_log_ratio)).sum(), response.sum())
    if rollout_logprobs is not None:
        metrics.update(mismatch_metrics(old_logprobs, rollout_logprobs, response))
    if s.use_tis:
        weights, tis_metrics = importance_weights(
            old_logprobs, rollout_logprobs, response, mode=s.tis_mode, tis_clip=s.tis_clip,
            tis_clip_low=s.tis_clip_low, icepop_low=s.icepop_low, icepop_high=s.icepop_high, level=s.tis_level,
        )
        pg_tok = pg_tok * weights
        metrics.update(tis_metrics)
    penalty_tok, penalty_metrics = _penalties(
        logprobs, valid, ref_logprobs, s.kl_loss_type, s.kl_loss_coef, entropy, s.entropy_coef
    )
    metrics.update(penalty_metrics)

    total_tok = pg_tok + penalty_tok
    numerator, count = aggregate(total_tok, valid, s.loss_agg_mode)
    # Metric sums in float64, so they add up the same whatever the micro-batch split.
    metrics["loss"] = metric(aggregate(total_tok.detach().double(), valid, s.loss_agg_mode)[0], count)
    metrics["pg_loss"] = metric(aggregate(pg_tok.detach().double(), valid, s.loss_agg_mode)[0], count)
    metrics.update(_ratio_metrics(log_ratio, sur, adv, valid, s.clip_low, s.clip_high, s.eps_clip_c is not None))
    if ratio_ref is not None:
        metrics.update(_reference_metrics(ratio_ref, sur, adv, valid, s.loss_mode, s.clip_low, s.clip_high,
                                          s.ref_clip_low, s.ref_clip_high))
    return numerator / float(denominator), metrics


def _reference_metrics(ratio_ref: torch.Tensor, sur: Surrogate, adv: torch.Tensor, valid: torch.Tensor,
                       loss_mode: str, clip_low: float, clip_high: float, ref_clip_low: float | None,
                       ref_clip_high: float | None) -> Metrics:
    """false_clip/* of the ratio the clip acts on: the token ratio, or GSPO's sequence ratio."""
    if loss_mode in SEQUENCE_RATIO_MODES:
        log_ref = torch.log(torch.where(valid, ratio_ref.detach().float(), 1.0))
        ratio_ref = torch.exp(sequence_mean(log_ref, valid)).expand_as(log_ref)
    ratio = torch.exp(sur.log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ref_low = clip_low if ref_clip_low is None else ref_clip_low
    ref_high = clip_high if ref_clip_high is None else ref_clip_high
    return reference_clip_metrics(ratio, ratio_ref, adv, sur.clips, valid, ref_low, ref_high)


def _ratio_metrics(
    log_ratio: torch.Tensor,
    sur: Surrogate,
    adv: torch.Tensor,
    valid: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: bool,
) -> Metrics:
    """ppo_kl = mean(old - new), log_ratio mean/std (token ratios), and the clip fractions of the
    ratio the clip acted on (the sequence ratio under GSPO)."""
    log_ratio = log_ratio.detach()
    clip_ratio = torch.exp(sur.log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    out = {"ppo_kl": masked_metric(-log_ratio, valid)}
    out.update(mean_and_square("log_ratio", log_ratio, valid))
    out.update(clip_metrics(clip_ratio, adv, sur.clips, valid, clip_low, clip_high, dual_clip))
    return out


def loss_mask(
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    rollout_rs: str = "",
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_low: float | None = None,
) -> torch.Tensor:
    """The tokens `policy_loss` aggregates, [B, T] bool: the response mask less what rollout_rs
    rejects. Count the denominator on it (loss_denominator) when rejection is on."""
    if not rollout_rs:
        return mask.bool()
    return rejection_mask(old_logprobs, rollout_logprobs, mask.bool(), rollout_rs, rollout_rs_threshold,
                          rollout_rs_threshold_low)[0]


def loss_token_weights(
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    old_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    use_tis: bool = False,
    rollout_rs: str = "",
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_low: float | None = None,
    **tis_kwargs,
) -> torch.Tensor:
    """The factor `policy_loss` puts on each token's surrogate before aggregating, detached.

    TIS / IcePop weight (use_tis; tis_kwargs as rollout_correction.importance_weights: mode,
    tis_clip, tis_clip_low, icepop_low, icepop_high, level) times the aggregation weight (1 / n_b
    under seq-mean-token-mean, n_b the kept tokens, else 1); 0 on padding and on rejected tokens.
    Calibrated Clipping weighs tokens by it, so that its clip fractions and balances are those of
    the loss. Up to the global denominator, which cancels in every fraction and balance.
    """
    response = mask.bool()
    valid = loss_mask(response, old_logprobs, rollout_logprobs, rollout_rs, rollout_rs_threshold,
                      rollout_rs_threshold_low)
    weights = valid.float()
    if use_tis:
        weights = weights * importance_weights(old_logprobs, rollout_logprobs, response, **tis_kwargs)[0].detach()
    if loss_agg_mode == "seq-mean-token-mean":
        weights = weights / valid.sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.where(valid, weights, 0.0)
