"""Pure-torch RL algorithms: advantages, policy losses, rollout correction, calibrated clipping, metrics."""

from megatron_rl.algo.advantages import dynamic_sampling_keep, grpo_advantages, overlong_penalty
from megatron_rl.algo.calib_solve import Rules
from megatron_rl.algo.calibrated_clip import CalibratedClipController, calibrate_bounds
from megatron_rl.algo.kl import kl_estimate
from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.algo.policy_loss import bounds_from_eps, clipped_surrogate, loss_denominator, policy_loss
from megatron_rl.algo.ratio_histogram import RatioHistogram
from megatron_rl.algo.rollout_correction import importance_weights, mismatch_metrics

__all__ = [
    "CalibratedClipController",
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
    "mismatch_metrics",
    "overlong_penalty",
    "policy_loss",
    "reduce_metrics",
]
