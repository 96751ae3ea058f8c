"""Entropy-surge detector: flags the mid-run entropy surge (and garbled outputs) of low-precision RL.

Fed one step's metrics at a time (`SurgeDetector.update`), it reads `entropy` (the policy's token
mean entropy, logged by the update) and `health/garbled_rate` (the fraction of the step's responses
that fail the task's format check, megatron_rl/loop/phases.py) and adds:

    health/entropy_min    running minimum m_t of the entropy over the counted steps <= t
    health/entropy_rise   rise_t = entropy_t / max(m_t, MIN_ENTROPY) - 1
    health/rise_streak    consecutive counted steps ending at t with rise >= entropy_rise
    health/surge          1.0 while rise_streak >= patience, else 0.0
    health/surge_step     the first surge's onset: the first step of the first streak that reached
                          `patience` (absent before any surge; never changes afterwards)
    health/garbled_streak, health/garbled_surge, health/garbled_surge_step
                          the same streak rule on health/garbled_rate >= the `garbled_rate`
                          threshold (only on steps that log a garbled rate; no warm-up)

Counted steps: steps >= warmup_steps whose entropy is a finite number. A step without one (a skipped
update, a NaN) changes nothing: the streak neither grows nor breaks, rise and min are absent from
that step's output, surge repeats the last value. The floor MIN_ENTROPY keeps the ratio finite
when the entropy collapses to 0. The same rule holds for garbled_rate. The state is a function of the metrics history
alone, so a resumed run rebuilds it with `from_history` from the records the MetricsLogger reloads
(docs/health.md).
"""

from __future__ import annotations

import math
from typing import Any

MIN_ENTROPY = 1e-6  # nats: floor of the running minimum (a collapsed policy's entropy may reach 0)


class _Streak:
    """Consecutive counted steps whose value is over a threshold; `onset` is the first step of the
    current streak, `first_surge` the onset of the first streak that reached `patience`."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.length = 0
        self.onset: int | None = None
        self.first_surge: int | None = None

    def add(self, step: int, over: bool) -> None:
        if not over:
            self.length, self.onset = 0, None
            return
        self.length += 1
        self.onset = step if self.onset is None else self.onset
        if self.length >= self.patience and self.first_surge is None:
            self.first_surge = self.onset

    @property
    def surging(self) -> bool:
        return self.length >= self.patience


def _finite(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


class SurgeDetector:
    """Running entropy minimum, rise streak and garbled streak; see the module docstring.

        detector = SurgeDetector.from_history(cfg.health, logger.history)  # resume: replay the log
        for step in ...:
            metrics.update(detector.update(step, metrics))
    """

    def __init__(self, entropy_rise: float = 0.5, patience: int = 10, warmup_steps: int = 0,
                 garbled_rate: float = 0.5) -> None:
        self.entropy_rise = entropy_rise
        self.warmup_steps = warmup_steps
        self.garbled_threshold = garbled_rate
        self.entropy_min: float | None = None
        self.rise = _Streak(patience)
        self.garbled = _Streak(patience)

    @classmethod
    def from_config(cls, health) -> "SurgeDetector":
        """From a config.HealthConfig."""
        return cls(health.entropy_rise, health.patience, health.warmup_steps, health.garbled_rate)

    @classmethod
    def from_history(cls, health, records: list[dict[str, Any]]) -> "SurgeDetector":
        """The detector of a run that has logged `records` (metrics.jsonl records, step order)."""
        detector = cls.from_config(health)
        for record in records:
            detector.update(record["step"], record)
        return detector

    @property
    def surge_step(self) -> int | None:
        return self.rise.first_surge

    def update(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """The health/* metrics of `step` from its `entropy` and `health/garbled_rate` (if any)."""
        out: dict[str, float] = {}
        entropy = _finite(metrics.get("entropy"))
        if entropy is not None and step >= self.warmup_steps:
            self.entropy_min = entropy if self.entropy_min is None else min(self.entropy_min, entropy)
            rise = entropy / max(self.entropy_min, MIN_ENTROPY) - 1.0
            self.rise.add(step, rise >= self.entropy_rise)
            out["health/entropy_min"], out["health/entropy_rise"] = self.entropy_min, rise
        out["health/rise_streak"] = float(self.rise.length)
        out["health/surge"] = float(self.rise.surging)
        if self.rise.first_surge is not None:
            out["health/surge_step"] = float(self.rise.first_surge)
        garbled = _finite(metrics.get("health/garbled_rate"))
        if garbled is not None:
            self.garbled.add(step, garbled >= self.garbled_threshold)
            out["health/garbled_streak"] = float(self.garbled.length)
            out["health/garbled_surge"] = float(self.garbled.surging)
            if self.garbled.first_surge is not None:
                out["health/garbled_surge_step"] = float(self.garbled.first_surge)
        return out
