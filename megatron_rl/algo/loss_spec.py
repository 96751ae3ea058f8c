"""The knobs of `policy_loss` as one frozen object, checked once when it is built."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.algo.kl import KL_TYPES
from megatron_rl.algo.rollout_correction import ROLLOUT_RS_MODES
from megatron_rl.algo.surrogates import CLIPPED_MODES, LOSS_MODES

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class LossSpec:
    """How `policy_loss` turns a micro-batch into a loss; the tensors and the denominator are its arguments.

    The names are the algo config's (config/algo.py documents each); the loop builds one
    per mini-batch from the config and the clip bounds in force (loop/phases.loss_spec) and every
    micro-batch's policy_loss call shares it. Invalid knobs raise ValueError when it is built.
    """

    clip_low: float
    """L: lower ratio bound (1 - eps_clip, or the calibrated one). CISPO: the weight's (may be 0)."""
    clip_high: float
    """H: upper ratio bound (1 + eps_clip_high, or the calibrated one)."""
    eps_clip_c: float | None = None
    """Dual-clip c > 1 for A < 0 (clipped loss modes only); None = off."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum (aggregate)."""
    loss_mode: str = "vanilla"
    """The per-token surrogate, surrogates.LOSS_MODES."""
    use_tis: bool = False
    """Weigh each token by the rollout correction (needs rollout_logprobs)."""
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_mode: str = "truncate"
    """truncate (TIS) | icepop (MIS), rollout_correction.importance_weights."""
    tis_level: str = "token"
    """token | sequence | geo_mean: the weight per token or per sequence."""
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    rollout_rs: str = ""
    """Rejection sampling ("" off | token_k1), rollout_correction.rejection_mask."""
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_low: float | None = None
    dro_beta: float = 1.0
    """DRO's quadratic penalty weight (loss_mode=dro)."""
    kl_loss_type: str = "k3"
    kl_loss_coef: float = 0.0
    """Weight of the KL penalty against the reference policy (needs ref_logprobs when != 0)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (needs entropy when != 0)."""
    ref_clip_low: float | None = None
    """Bounds of the high-precision reference ratio for the false-clip metrics; None = clip_low /
    clip_high. Set them to 1 -/+ eps when (L, H) are calibrated."""
    ref_clip_high: float | None = None
    force_on_policy_ratio: bool = False
    """NeMo-RL's force_on_policy_ratio: old log-probs := this forward's own, detached, so the ratio is
    exactly 1 and the gradient is the on-policy one (-A grad log pi for the vanilla loss; no token
    is clipped). The TIS / IcePop weights and the mismatch metrics then use these log-probs too. The
    loop sets it on the first mini-batch only (the one trained at theta_old)."""

    def __post_init__(self) -> None:
        _check(self)


def _check(s: LossSpec) -> None:
    if s.loss_mode not in LOSS_MODES:
        raise ValueError(f"loss_mode must be one of {LOSS_MODES}, got {s.loss_mode!r}")
    if s.eps_clip_c is not None and s.loss_mode not in CLIPPED_MODES:
        raise ValueError(f"eps_clip_c (dual-clip) needs a clipped loss_mode {CLIPPED_MODES}, got {s.loss_mode!r}")
    if s.rollout_rs not in ROLLOUT_RS_MODES:
        raise ValueError(f"rollout_rs must be one of {ROLLOUT_RS_MODES}, got {s.rollout_rs!r}")
    if s.loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {s.loss_agg_mode!r}")
    if s.kl_loss_type not in KL_TYPES:
        raise ValueError(f"kl_loss_type must be one of {KL_TYPES}, got {s.kl_loss_type!r}")
    if not 0.0 <= s.clip_low < s.clip_high:
        raise ValueError(f"need 0 <= clip_low < clip_high, got clip_low={s.clip_low}, clip_high={s.clip_high}")
    if s.force_on_policy_ratio and s.rollout_rs:
        raise ValueError(f"force_on_policy_ratio replaces pi_old by the training forward's own log-probs; "
                         f"rollout_rs={s.rollout_rs!r} rejects on pi_old / pi_rollout before the update")
    if s.eps_clip_c is not None and not s.eps_clip_c > 1.0:
        raise ValueError(f"eps_clip_c (dual-clip) must be > 1, got {s.eps_clip_c}")
