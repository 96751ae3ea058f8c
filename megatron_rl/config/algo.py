"""The `algo` section: advantage estimator, policy loss and its corrections, KL, DAPO refill."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.algo.loss_spec import LOSS_AGG_MODES
from megatron_rl.algo.rollout_correction import ROLLOUT_RS_MODES, TIS_LEVELS
from megatron_rl.algo.surrogates import CLIPPED_MODES, LOSS_MODES

if TYPE_CHECKING:
    from megatron_rl.config.run import RunConfig


@dataclass
class AlgoConfig:
    """Advantage estimator and policy loss; knob names follow slime/miles."""

    advantage_estimator: str = "grpo"
    """grpo (group-normalised) | dr_grpo (no std) | rloo (leave-one-out baseline)."""
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    """DAPO clip-higher uses 0.28."""
    eps_clip_c: float | None = None
    """Dual-clip constant (> 1) for negative advantages; None disables it."""
    loss_agg_mode: str = "token-mean"
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all agree (no advantage signal)."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: linear penalty within the last N tokens before max_new_tokens; 0 = off."""
    overlong_penalty_factor: float = 1.0
    use_tis: bool = True
    tis_mode: str = "truncate"
    """truncate (TIS) | icepop (MIS: mask tokens whose rollout ratio leaves [icepop_low, icepop_high])."""
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as old log-probs instead of a trainer recompute."""
    force_on_policy_ratio: bool = False
    """NeMo-RL's force_on_policy_ratio (prime-rl's exact_on_policy_ratio): the first mini-batch of the
    first PPO epoch, trained at theta_old, takes its old log-probs from its own training forward
    (detached), so its ratio is exactly 1 whatever the precision noise; later mini-batches use the
    recomputed old log-probs as usual. With one mini-batch and one epoch (NeMo-RL's setting) the
    old-log-prob forward is skipped unless something else needs it (a reference model, the BF16
    shadow, calibrated FP8 KV scales). Refused with use_rollout_logprobs and rollout_rs, and with
    calibration or diagnosis when the calibration mini-batch is the forced one."""
    old_logprob_precision: str = "train"
    """train | bf16: the old log-probs' forward in the training recipe (precision.train_recipe, the
    paper's setting) or without FP8 (the BF16 path), the "run the old log-probs in BF16" rival of
    Calibrated Clipping: the ratio becomes FP8(theta) / BF16(theta_old). Refused with
    use_rollout_logprobs (no trainer forward)."""
    kl_loss_type: str = "k3"
    kl_loss_coef: float = 0.0
    entropy_coef: float = 0.0
    loss_mode: str = "vanilla"
    """Per-token surrogate (verl's actor.policy_loss.loss_mode; docs/algo.md has each formula):
    vanilla (PPO clip) | gspo (sequence ratio exp(mean log r), clipped per sequence; the paper's
    eps 3e-4 / 4e-4) | gspo_token (GSPO-token) | cispo (-sg(clip(r)) A log pi; eps_clip may be >= 1,
    no lower bound) | reinforce (ratio-free -A log pi) | dro (-(A log pi - dro_beta/2 (log r)^2))."""
    tis_level: str = "token"
    """TIS / IcePop weight per token, or per sequence: sequence = exp(sum_t log(pi_old / pi_rollout))
    (verl rollout_is=sequence, NeMo-RL's sequence-level weights), geo_mean = exp(mean_t ...)."""
    rollout_rs: str = ""
    """Rejection sampling (verl's rollout_rs): "" off | token_k1 (tokens with log(pi_rollout / pi_old)
    outside [log rollout_rs_threshold_low, log rollout_rs_threshold] leave the loss mask; TIS applies
    on the rest)."""
    rollout_rs_threshold: float = 2.0
    """Upper ratio bound of token_k1 (verl's rollout_rs_threshold, here a float)."""
    rollout_rs_threshold_low: float | None = None
    """Lower ratio bound of token_k1; None = 1 / rollout_rs_threshold (verl's one-value form)."""
    dro_beta: float = 1.0
    """DRO's quadratic penalty weight beta (Tinker's dro `beta`), loss_mode=dro only."""
    kl_reward_coef: float = 0.0
    """KL in the reward (verl's use_kl_in_reward / algorithm.kl_ctrl.kl_coef, slime's --kl-coef): each
    response's reward loses kl_reward_coef x the sum over its tokens of the `kl_reward_type` estimate
    between the old policy and the reference, before the advantages. 0 = off. Either coefficient
    > 0 builds the reference model (docs/algo.md, Reference model)."""
    kl_reward_type: str = "k1"
    """k1 | k2 | k3: the per-token estimator of the reward penalty (verl's algorithm.kl_penalty,
    default k1 = log pi_old - log pi_ref, the InstructGPT penalty)."""
    ref_precision: str = "bf16"
    """bf16 | train: the reference model's forward without FP8 (the BF16 path), or in the training
    recipe (precision.train_recipe, as the old log-probs). bf16 by default: the reference is the
    initial policy itself, not its FP8 approximation."""
    max_gen_batches: int = 10
    """DAPO refill (dynamic_sampling): sample further batches of data.prompts_per_step prompts until
    that many informative groups are kept, at most this many batches per step (verl's
    algorithm.filter_groups.max_num_gen_batches; 10 as its DAPO recipe: a step costs at most 10
    rollouts). 0 = no limit; 1 = no refill (train on the kept part of one batch)."""
    on_max_gen_batches: str = "train"
    """train | fail: at the limit with fewer groups kept, train on those (logged: dapo/kept_fraction
    < 1, a warning) or stop with an error (verl raises). train: one short batch late in a long run
    is no reason to lose the run."""

    @property
    def needs_reference(self) -> bool:
        """A KL term (loss or reward) needs the frozen reference policy."""
        return self.kl_loss_coef > 0 or self.kl_reward_coef > 0


CHOICES = {
    "advantage_estimator": ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"),
    "loss_agg_mode": LOSS_AGG_MODES,
    "tis_mode": ("truncate", "icepop"),
    "kl_loss_type": ("k1", "k2", "k3"),
    "kl_reward_type": ("k1", "k2", "k3"),
    "ref_precision": ("bf16", "train"),
    "old_logprob_precision": ("train", "bf16"),
    "on_max_gen_batches": ("train", "fail"),
    "loss_mode": LOSS_MODES,
    "tis_level": TIS_LEVELS,
    "rollout_rs": ROLLOUT_RS_MODES,
}
POSITIVE: tuple[str, ...] = ()


def check_clip(a: AlgoConfig) -> None:
    if not 0.0 < a.eps_clip < (math.inf if a.loss_mode == "cispo" else 1.0):
        raise ValueError(f"config key 'algo.eps_clip': must be in (0, 1), got {a.eps_clip}")
    if a.eps_clip_high <= 0.0:
        raise ValueError(f"config key 'algo.eps_clip_high': must be > 0, got {a.eps_clip_high}")
    if a.eps_clip_c is not None and a.eps_clip_c <= 1.0:
        raise ValueError(f"config key 'algo.eps_clip_c': dual-clip needs c > 1, got {a.eps_clip_c}")


def check_losses(a: AlgoConfig) -> None:
    """Loss-mode combinations, sequence-level weights, rejection (with calibration: calib.py)."""
    if a.eps_clip_c is not None and a.loss_mode not in CLIPPED_MODES:
        raise ValueError(f"config key 'algo.eps_clip_c': dual-clip bounds the clipped surrogate; "
                         f"loss_mode={a.loss_mode!r} has none (use one of {list(CLIPPED_MODES)})")
    if a.tis_level != "token" and not a.use_tis:
        raise ValueError(f"config key 'algo.tis_level': {a.tis_level!r} weights need algo.use_tis=true")
    if not a.rollout_rs_threshold > 0.0:
        raise ValueError(f"config key 'algo.rollout_rs_threshold': must be > 0, got {a.rollout_rs_threshold}")
    low = a.rollout_rs_threshold_low
    if low is not None and not 0.0 < low <= a.rollout_rs_threshold:
        raise ValueError(f"config key 'algo.rollout_rs_threshold_low': must be in (0, rollout_rs_threshold="
                         f"{a.rollout_rs_threshold}], got {low}")
    if not a.dro_beta >= 0.0:
        raise ValueError(f"config key 'algo.dro_beta': must be >= 0, got {a.dro_beta}")


def check_old_logprobs(cfg: RunConfig) -> None:
    """Where the old log-probs come from: one source per mini-batch, named by one knob."""
    a, t, c = cfg.algo, cfg.train, cfg.calib
    if a.use_rollout_logprobs and a.force_on_policy_ratio:
        raise ValueError("config key 'algo.force_on_policy_ratio': takes the old log-probs from the trainer's own "
                         "forward, algo.use_rollout_logprobs takes them from the engine; set one")
    if a.use_rollout_logprobs and a.old_logprob_precision != "train":
        raise ValueError("config key 'algo.old_logprob_precision': with algo.use_rollout_logprobs the old "
                         "log-probs are the engine's, no trainer forward runs in any precision")
    if a.force_on_policy_ratio and a.rollout_rs:
        raise ValueError(f"config key 'algo.force_on_policy_ratio': algo.rollout_rs={a.rollout_rs!r} rejects tokens "
                         f"on pi_old / pi_rollout before the update, and the forced mini-batch has no pi_old")
    if a.force_on_policy_ratio and (c.enabled or c.diagnose) and t.ppo_epochs * t.num_mini_batches == 1:
        raise ValueError("config key 'algo.force_on_policy_ratio': with one mini-batch and one epoch the "
                         "calibration mini-batch (calib.enabled / calib.diagnose) is the forced one, whose "
                         "ratio is 1 by construction; use more mini-batches or turn calibration off")


def check_reference(cfg: RunConfig) -> None:
    """KL coefficients, and the initial weights the reference model is built from (model.hf_dir,
    model.megatron_ckpt, or the tiny built-in model) checked before any rollout."""
    a, m = cfg.algo, cfg.model
    for key in ("kl_loss_coef", "kl_reward_coef"):
        value = getattr(a, key)
        if not (value >= 0 and value < float("inf")):
            raise ValueError(f"config key 'algo.{key}': must be finite and >= 0, got {value}")
    if not a.needs_reference:
        return
    if m.hf_dir and not (Path(m.hf_dir) / "config.json").is_file():
        raise ValueError(f"config key 'model.hf_dir': the reference model (algo.kl_loss_coef / kl_reward_coef > 0) "
                         f"is built from the initial weights, and {m.hf_dir} holds no HF checkpoint (config.json)")
    if m.megatron_ckpt and not Path(m.megatron_ckpt).is_dir():
        raise ValueError(f"config key 'model.megatron_ckpt': the reference model is built from these initial "
                         f"weights, and {m.megatron_ckpt} is not a folder")


def check_refill(a: AlgoConfig) -> None:
    if a.max_gen_batches < 0:
        raise ValueError(f"config key 'algo.max_gen_batches': must be >= 0 (0 = no limit), got {a.max_gen_batches}")
