"""Run telemetry: one JSONL line and the same TensorBoard scalars per step, a progress bar, a summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PROGRESS_KEYS = (("reward/mean", "reward"), ("entropy", "ent"), ("clip/low_neg", "clip-"),
                 ("calib/low", "L"), ("calib/high", "H"))


class MetricsLogger:
    """Writes `metrics.jsonl` (one object per step, keys as in design.md section 1) and TensorBoard.

    Resume-safe: on resume the JSONL file is truncated to the steps before `start_step`, so a
    resumed run's log reads exactly like an uninterrupted one.
    """

    def __init__(self, log_dir: str | Path, *, tensorboard: bool = True, progress: bool = True,
                 total_steps: int = 0, start_step: int = 0, enabled: bool = True) -> None:
        self.dir = Path(log_dir)
        self.enabled = enabled
        self.path = self.dir / "metrics.jsonl"
        self._tb = None
        self._bar = None
        self.history: list[dict[str, Any]] = []
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._truncate(start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.dir / "tb"), purge_step=start_step)
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, desc="rl", unit="step",
                             dynamic_ncols=True)

    def _truncate(self, start_step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] < start_step]
        self.history = [json.loads(line) for line in kept]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}
        self.history.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if value is not None and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.set_postfix({short: f"{metrics[k]:.3g}" for k, short in PROGRESS_KEYS
                                   if metrics.get(k) is not None}, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()

    def summary(self, keys: tuple[str, ...] = ("reward/mean", "entropy", "clip/low_neg")) -> str:
        """First-vs-last-5-steps table of the key metrics, as text."""
        if not self.history:
            return "no steps logged"
        lines = [f"{'metric':<28}{'first':>12}{'last 5 mean':>14}"]
        for key in keys:
            vals = [r[key] for r in self.history if r.get(key) is not None]
            if vals:
                tail = vals[-5:]
                lines.append(f"{key:<28}{vals[0]:>12.4f}{sum(tail) / len(tail):>14.4f}")
        return "\n".join(lines)


def _finite_or_none(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
