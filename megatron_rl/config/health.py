"""The `health` section: the entropy-surge detector."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HealthConfig:
    """The entropy-surge detector (megatron_rl/telemetry/health.py, docs/health.md)."""

    entropy_rise: float = 0.5
    """Rise threshold: a step rises when entropy / running minimum - 1 >= this (0.5 = 50% above
    the lowest entropy so far; paper.md's failure multiplies the entropy several times over)."""
    patience: int = 10
    """Consecutive rising steps (steps without an entropy neither count nor break the streak) that
    make a surge; also the consecutive steps of garbled_rate that make a garbled surge."""
    warmup_steps: int = 0
    """Steps 0..warmup_steps-1 are ignored for the minimum and never rise. 0: no step is exempt,
    so a surge from the start is seen; set it when the first RL steps after SFT are unrepresentative."""
    garbled_rate: float = 0.5
    """Garbled surge threshold: fraction of a step's responses that fail the task's format check."""


CHOICES: dict[str, tuple] = {}
POSITIVE = ("entropy_rise", "patience")


def check_health(h: HealthConfig) -> None:
    if h.warmup_steps < 0:
        raise ValueError(f"config key 'health.warmup_steps': must be >= 0, got {h.warmup_steps}")
    if not 0.0 < h.garbled_rate <= 1.0:
        raise ValueError(f"config key 'health.garbled_rate': must be in (0, 1], got {h.garbled_rate}")
