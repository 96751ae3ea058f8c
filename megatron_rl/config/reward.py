"""The `reward` section: a built-in or user reward function, or a remote endpoint."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    name: str = ""
    """A built-in reward (exact_match | position_match | final_answer | math_verify | dapo | dapo_accuracy)
    or a user function by import path: `my_pkg.rewards:score` or `path/to/file.py:score` (docs/rewards.md).
    Resolved and signature-checked at config load. Empty = the built-in task's own reward
    (math_verify for a data.path dataset)."""
    timeout_s: float = 10.0
    """Seconds per sample (per batch when batched, per attempt with url) before it scores 0."""
    batched: bool = False
    """The function takes lists (responses, answers, **extra lists) and returns a list."""
    url: str = ""
    """Remote reward: POST each step's batch as JSON to this http(s) endpoint (docs/rewards.md);
    replaces `name`."""
    max_retries: int = 3
    """url only: retries after a connection error, a timeout, HTTP 429 or 5xx; then the batch scores 0."""
    retry_backoff_s: float = 1.0
    """url only: sleep before retry k (1-based) is retry_backoff_s * 2**(k-1) seconds."""
    num_workers: int = 4
    """Reward worker processes per scoring rank (verl's reward_model.num_workers, NeMo-RL's
    env.math.num_workers): a step's samples are scored concurrently, so slow or hanging rewards
    cost about their total time / num_workers. A batched or url reward gets the whole batch in one
    call (it may score relative to the batch). Only the first rank of each model replica scores."""


CHOICES: dict[str, tuple] = {}
POSITIVE = ("timeout_s",)


def check_reward(r: RewardConfig) -> None:
    """A typo in reward.name fails here, on every rank, before the actor or any server is built."""
    from megatron_rl.rewards import get_reward_fn

    if r.max_retries < 0:
        raise ValueError(f"config key 'reward.max_retries': must be >= 0, got {r.max_retries}")
    if r.num_workers < 1:
        raise ValueError(f"config key 'reward.num_workers': must be >= 1, got {r.num_workers}")
    if r.retry_backoff_s < 0:
        raise ValueError(f"config key 'reward.retry_backoff_s': must be >= 0, got {r.retry_backoff_s}")
    if r.url:
        if not r.url.startswith(("http://", "https://")):
            raise ValueError(f"config key 'reward.url': expected an http:// or https:// URL, got {r.url!r}")
        if r.name:
            raise ValueError("config key 'reward.url': set either reward.url or reward.name, not both")
        return
    if r.name:
        try:
            get_reward_fn(r.name, batched=r.batched)
        except ValueError as err:
            raise ValueError(f"config key 'reward.name': {err}") from None
