"""The learning-rate schedule: Megatron-Core's OptimizerParamScheduler over the actor's optimizer."""

from __future__ import annotations

from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """Warm-up and decay in scheduler steps (the loop advances one per trained RL step).

    lr(n) = lr * n / warmup_steps for n <= warmup_steps (from 0, Megatron's lr_warmup_init), then
    constant, or decays (linear | cosine) from lr to min_lr at n = decay_steps and stays there.
    """

    warmup_steps: int = 0
    decay_style: str = "constant"
    decay_steps: int = 1
    min_lr: float = 0.0


def build_scheduler(optimizer, *, lr: float, weight_decay: float, schedule: LRSchedule):
    """Megatron's OptimizerParamScheduler (optimizer_param_scheduler.py): it writes every param
    group's lr and weight_decay (times the group's wd_mult: 0 for biases and norms) at each step.

    Each param group's own max_lr / min_lr win over the scheduler's (get_lr reads
    param_group.get('min_lr', ...)), so the optimizer must be built with the same lr and min_lr.
    On load the config's values win and the checkpoint gives the step count
    (override_opt_param_scheduler): a resumed run follows the schedule its config states.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if schedule.decay_style not in DECAY_STYLES:
        raise ValueError(f"lr decay style {schedule.decay_style!r} is not one of {list(DECAY_STYLES)}")
    # Megatron asserts warmup < decay steps even for a constant schedule, where decay_steps is unused.
    decay_steps = max(schedule.decay_steps, schedule.warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=schedule.min_lr, lr_warmup_steps=schedule.warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=schedule.decay_style, start_wd=weight_decay,
        end_wd=weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
