"""Reward functions (exact match, final answer, math-verify), their registry, and the timeout-guarded runner."""

from megatron_rl.rewards.functions import (
    REWARD_FNS,
    RewardFn,
    exact_match,
    final_answer,
    get_answer_extractor,
    get_reward_fn,
    math_verify_reward,
    position_match,
    register_reward_fn,
)
from megatron_rl.rewards.runner import RewardRunner

__all__ = [
    "REWARD_FNS",
    "RewardFn",
    "RewardRunner",
    "exact_match",
    "final_answer",
    "get_answer_extractor",
    "get_reward_fn",
    "math_verify_reward",
    "position_match",
    "register_reward_fn",
]
