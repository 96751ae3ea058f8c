"""Reward functions (built-in, user import paths, HTTP), their registry, and the timeout-guarded runner."""

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
from megatron_rl.rewards.http import HttpReward
from megatron_rl.rewards.runner import RewardRunner, normalize

__all__ = [
    "REWARD_FNS",
    "HttpReward",
    "RewardFn",
    "RewardRunner",
    "exact_match",
    "final_answer",
    "get_answer_extractor",
    "get_reward_fn",
    "math_verify_reward",
    "normalize",
    "position_match",
    "register_reward_fn",
]
