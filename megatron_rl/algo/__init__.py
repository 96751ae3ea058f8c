"""Pure-torch RL algorithms: advantages, policy losses, rollout correction, calibrated clipping, metrics."""

from megatron_rl.algo.advantages import (
    dynamic_sampling_keep,
    grpo_advantages,
    overlong_penalty,
    reinforce_baseline_advantages,
)
from megatron_rl.algo.calib_solve import Rules
from megatron_rl.algo.calibrated_clip import CalibratedClipController, calibrate_bounds
from megatron_rl.algo.kl import kl_estimate
from megatron_rl.algo.loss_spec import LossSpec
from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.algo.policy_loss import bounds_from_eps, loss_denominator, loss_mask, policy_loss
from megatron_rl.algo.ratio_histogram import RatioHistogram
from megatron_rl.algo.rollout_correction import importance_weights, mismatch_metrics, rejection_mask
from megatron_rl.algo.surrogates import LOSS_MODES, clipped_surrogate, surrogate

__all__ = [
    "LOSS_MODES",
    "CalibratedClipController",
    "LossSpec",
    "RatioHistogram",
    "Rules",
    "bounds_from_eps",
    "calibrate_bounds",
    "clipped_surrogate",
    "dynamic_sampling_keep",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "loss_denominator",
    "loss_mask",
    "mismatch_metrics",
    "overlong_penalty",
    "policy_loss",
    "reduce_metrics",
    "reinforce_baseline_advantages",
    "rejection_mask",
    "surrogate",
]
