"""The `train` section: steps, batch sizes, the optimizer and its schedule, packing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.config.run import RunConfig


@dataclass
class TrainConfig:
    num_steps: int = 40
    num_mini_batches: int = 2
    """Optimizer steps per RL step (PPO mini-batches)."""
    ppo_epochs: int = 1
    micro_batch_size: int = 16
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 1234
    sft_steps: int = 0
    """Supervised warm start (built-in tasks) before RL."""
    sft_lr: float = 1e-3
    sft_batch_size: int = 32
    logprob_chunk_size: int = 2048
    """Tokens per chunk of the log-prob / entropy computation (response tokens only, recomputed in
    backward): extra memory O(chunk x vocab / TP) instead of O(sequence x vocab / TP). 0 = the whole
    micro-batch at once, every position (the reference path)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of a packed micro-batch: sequences are packed (positions and attention restart
    per sequence) into micro-batches of at most this many tokens plus the FP8 padding. 0 = padded
    rows, micro_batch_size per micro-batch. Must hold the longest sequence (prompt + response)."""
    allow_oversized: bool = False
    """Start on GPUs even when the memory plan (`megatron-rl plan`, docs/plan.md) says the config
    does not fit. Off: training refuses such a config at start, printing the plan."""
    colocated_protocol: bool = True
    """Colocated engines (the embedded one always): release the engine's memory while training and
    offload the trainer's parameters, gradients and optimizer state to host memory while the engine
    works, in the order of megatron_rl/loop/colocated.py. On CPU it frees nothing that matters but runs
    the same order, so the CPU loop exercises it; false keeps both resident."""
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 to `lr` over this many trained RL steps (Megatron's
    OptimizerParamScheduler; a step that trains with lr n / N * lr, so the first trains with 0, as
    in Megatron and verl). 0 = off. The DAPO recipe warms up over 20 steps."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine: after the warm-up, lr stays, or decays to `min_lr` at
    `lr_decay_steps` and stays there (Megatron's --lr-decay-style)."""
    lr_decay_steps: int = 0
    """Trained RL steps at which the decay reaches `min_lr` (warm-up included); 0 = train.num_steps."""
    min_lr: float = 0.0
    """Floor of the linear / cosine decay, in [0, lr] (Megatron's --min-lr, default 0)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay (torch and Megatron default)."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay (torch and Megatron default; slime's RL baselines use 0.98)."""
    adam_eps: float = 1e-8
    """AdamW's denominator term (torch and Megatron default)."""


CHOICES = {"lr_decay_style": ("constant", "linear", "cosine")}
POSITIVE = ("num_mini_batches", "ppo_epochs", "micro_batch_size")


def check_token_budget(cfg: RunConfig) -> None:
    t = cfg.train
    if t.logprob_chunk_size < 0:
        raise ValueError(f"config key 'train.logprob_chunk_size': must be >= 0, got {t.logprob_chunk_size}")
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if t.max_tokens_per_micro_batch < 0 or 0 < t.max_tokens_per_micro_batch < longest:
        raise ValueError(f"config key 'train.max_tokens_per_micro_batch': {t.max_tokens_per_micro_batch} "
                         f"must be 0 (off) or hold the longest sequence, data.max_prompt_len + "
                         f"rollout.max_new_tokens = {longest}")


def check_optimizer(t: TrainConfig) -> None:
    """The learning-rate schedule and AdamW's constants (Megatron asserts on some of them)."""
    for key in ("lr", "weight_decay"):
        if getattr(t, key) < 0:
            raise ValueError(f"config key 'train.{key}': must be >= 0, got {getattr(t, key)}")
    if not 0.0 <= t.min_lr <= t.lr:
        raise ValueError(f"config key 'train.min_lr': must be in [0, train.lr={t.lr}], got {t.min_lr}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ValueError(f"config key 'train.{key}': must be in [0, 1), got {getattr(t, key)}")
    if not t.adam_eps > 0:
        raise ValueError(f"config key 'train.adam_eps': must be > 0, got {t.adam_eps}")
    for key in ("lr_warmup_steps", "lr_decay_steps"):
        if getattr(t, key) < 0:
            raise ValueError(f"config key 'train.{key}': must be >= 0, got {getattr(t, key)}")
    decay_steps = t.lr_decay_steps or t.num_steps
    if t.lr_decay_style != "constant" and t.lr_warmup_steps >= decay_steps:
        raise ValueError(f"config key 'train.lr_warmup_steps': {t.lr_warmup_steps} must be below the decay's "
                         f"end, train.lr_decay_steps (0 = train.num_steps) = {decay_steps}")
