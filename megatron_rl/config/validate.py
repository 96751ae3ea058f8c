"""Validation at load: every section's choices and positive fields, then its own and the
cross-section rules, in a fixed order; the first failure is one ValueError naming the key."""

from __future__ import annotations

from typing import Any

from megatron_rl.config import algo, calib, checkpoint, data, health, log, model, parallel, precision, reward
from megatron_rl.config import eval as evaluation  # the section module, not the builtin
from megatron_rl.config import rollout, sync, train
from megatron_rl.config.run import RunConfig

# The sections whose CHOICES / POSITIVE tables are checked, by their key in RunConfig.
SECTIONS = {
    "model": model, "parallel": parallel, "precision": precision, "algo": algo, "calib": calib,
    "rollout": rollout, "sync": sync, "data": data, "reward": reward, "train": train, "log": log,
    "checkpoint": checkpoint, "health": health, "eval": evaluation,
}


def get(obj: Any, path: str) -> Any:
    """The value at a dotted path (`rollout.sglang.tp_size`) of a config or a section."""
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _check_tables(cfg: RunConfig) -> None:
    for name, module in SECTIONS.items():
        for key, choices in module.CHOICES.items():
            if get(cfg, f"{name}.{key}") not in choices:
                raise ValueError(f"config key '{name}.{key}': {get(cfg, f'{name}.{key}')!r} is not one of "
                                 f"{list(choices)}")
    for name, module in SECTIONS.items():
        for key in module.POSITIVE:
            if not get(cfg, f"{name}.{key}") > 0:
                raise ValueError(f"config key '{name}.{key}': must be > 0, got {get(cfg, f'{name}.{key}')!r}")


def validate(cfg: RunConfig) -> RunConfig:
    """Check value ranges and cross-field rules; raise one ValueError naming the key."""
    _check_tables(cfg)
    algo.check_clip(cfg.algo)
    calib.check_smoothing(cfg.calib)
    rollout.check_top_p(cfg.rollout)
    precision.check_block_size(cfg.precision)
    rollout.check_group_size(cfg.rollout)
    calib.check_needs_fp8(cfg)
    train.check_token_budget(cfg)
    health.check_health(cfg.health)
    model.check_outliers(cfg.model)
    rollout.check_sglang(cfg)
    parallel.check_layout(cfg)
    calib.check_controller(cfg)
    algo.check_losses(cfg.algo)
    algo.check_old_logprobs(cfg)
    calib.check_loss_match(cfg)
    evaluation.check_eval(cfg)
    checkpoint.check_keep_best(cfg)
    reward.check_reward(cfg.reward)
    data.check_data(cfg.data)
    rollout.check_sampling(cfg)
    log.check_log(cfg.log)
    checkpoint.check_retention(cfg.checkpoint)
    train.check_optimizer(cfg.train)
    algo.check_reference(cfg)
    algo.check_refill(cfg.algo)
    parallel.check_host_wait(cfg)
    return cfg
