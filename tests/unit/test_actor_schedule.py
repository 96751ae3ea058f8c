"""The learning-rate schedule through Megatron's OptimizerParamScheduler, against its formula by hand."""

import math

import pytest


from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.schedule import LRSchedule

LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 3, 8


def expected_lr(n: int, style: str) -> float:
    """Megatron's get_lr written out: linear warm-up from 0, then the decay to MIN_LR at DECAY."""
    if n <= WARMUP:
        return LR * n / WARMUP
    if style == "constant":
        return LR
    if n > DECAY:
        return MIN_LR
    ratio = (n - WARMUP) / (DECAY - WARMUP)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return MIN_LR + coeff * (LR - MIN_LR)


def build(qwen2_dir, parallel, style: str, **kw) -> MegatronActor:
    schedule = LRSchedule(warmup_steps=WARMUP, decay_style=style, decay_steps=DECAY, min_lr=MIN_LR)
    return MegatronActor.build(qwen2_dir, parallel=parallel, lr=LR, lr_schedule=schedule, **kw)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_per_step_follows_megatrons_formula(qwen2_dir, single_parallel, style):
    actor = build(qwen2_dir, single_parallel, style)
    lrs = [actor.lr] + [actor.advance_lr_schedule() for _ in range(DECAY + 2)]
    assert lrs == pytest.approx([expected_lr(n, style) for n in range(DECAY + 3)], rel=1e-12, abs=1e-15)
    assert lrs[0] == 0.0 and lrs[WARMUP] == pytest.approx(LR)
    # every param group follows (Megatron's min_lr per group is the schedule's, not lr)
    assert {g["lr"] for g in actor.optimizer.param_groups} == {lrs[-1]}


def test_optimizer_knobs_reach_adam_and_weight_decay_skips_norms(qwen2_dir, single_parallel):
    actor = build(qwen2_dir, single_parallel, "cosine", adam_betas=(0.9, 0.98), adam_eps=1e-6,
                  weight_decay=0.1)
    groups = actor.optimizer.param_groups
    assert {g["betas"] for g in groups} == {(0.9, 0.98)} and {g["eps"] for g in groups} == {1e-6}
    # Megatron's wd_mult: 0 for biases and 1-D (norm) params, 1 for the matrices
    decay = {g["weight_decay"] for g in groups for p in g["params"] if p.dim() > 1}
    no_decay = {g["weight_decay"] for g in groups for p in g["params"] if p.dim() == 1}
    assert decay == {0.1} and no_decay == {0.0}


def test_schedule_state_resumes(qwen2_dir, single_parallel):
    actor = build(qwen2_dir, single_parallel, "cosine")
    for _ in range(5):
        actor.advance_lr_schedule()
    state = actor.scheduler.state_dict()
    fresh = build(qwen2_dir, single_parallel, "cosine")
    fresh.scheduler.load_state_dict(state)
    assert fresh.lr == pytest.approx(expected_lr(5, "cosine"), rel=1e-12)
    assert fresh.advance_lr_schedule() == pytest.approx(expected_lr(6, "cosine"), rel=1e-12)


def test_bad_min_lr_is_refused():
    from megatron_rl.config import load_config

    with pytest.raises(ValueError, match="train.min_lr"):
        load_config(None, ["train.lr=1e-4", "train.min_lr=1e-3"])
    with pytest.raises(ValueError, match="train.lr_warmup_steps"):
        load_config(None, ["train.num_steps=10", "train.lr_warmup_steps=10", "train.lr_decay_style=linear"])
    with pytest.raises(ValueError, match="train.adam_beta2"):
        load_config(None, ["train.adam_beta2=1.0"])
