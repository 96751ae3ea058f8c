"""Run telemetry: one JSONL line and the same TensorBoard (and W&B) scalars per step, a progress bar
or a one-line summary per step, and an end-of-run summary."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

PROGRESS_KEYS = (("reward/mean", "reward"), ("entropy", "ent"), ("clip/low_neg", "clip-"),
                 ("calib/low", "L"), ("calib/high", "H"), ("reward/errors", "rerr"), ("reward/timeouts", "rtmo"))
# The per-step line when the progress bar is off (a Slurm log): key, label, format.
LINE_KEYS = (("reward/mean", "reward", ".4g"), ("reward/accuracy", "acc", ".3g"), ("entropy", "ent", ".4g"),
             ("response_length/mean", "len", ".1f"), ("response_length/clip_ratio", "trunc", ".3g"),
             ("clip/low_neg", "clip-", ".3g"), ("calib/low", "L", ".4g"), ("calib/high", "H", ".4g"),
             ("grad_norm", "gnorm", ".3g"), ("lr", "lr", ".3g"), ("time/step", "s", ".1f"),
             ("reward/errors", "rerr", ".0f"), ("reward/timeouts", "rtmo", ".0f"))
# The eval metrics put on the console when a step has them: the scores and the reward failures.
EVAL_LINE_KEY = re.compile(r"eval/.+/((avg|pass|maj)@[0-9]+|reward_errors|reward_timeouts)")

log = logging.getLogger("megatron_rl.telemetry")


def step_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    """`step 3/40 reward 0.4 ent 0.31 ...`: the metrics of LINE_KEYS that the step has. Steps are
    numbered from 0, as in metrics.jsonl and the sample dumps (the last is total - 1)."""
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    for key, label, fmt in LINE_KEYS:
        value = metrics.get(key)
        if value is not None and math.isfinite(value):
            parts.append(f"{label} {value:{fmt}}")
    if metrics.get("step/skipped"):
        parts.append("(skipped)")
    return " ".join(parts)


def eval_line(step: int, metrics: dict[str, Any]) -> str | None:
    """`eval at step 3: heldout/avg@4 0.5 heldout/pass@4 0.75 ...` (EVAL_LINE_KEY), None without any."""
    parts = [f"{key.removeprefix('eval/')} {value:.4g}" for key, value in sorted(metrics.items())
             if EVAL_LINE_KEY.fullmatch(key) and value is not None and math.isfinite(value)]
    return f"eval at step {step}: " + " ".join(parts) if parts else None


class MetricsLogger:
    """Writes `metrics.jsonl` (one object per step, keys as in design.md section 1) and TensorBoard.

    Resume-safe: on resume the JSONL file is truncated to the steps before `start_step`, so a
    resumed run's log reads exactly like an uninterrupted one.
    """

    def __init__(self, log_dir: str | Path, *, tensorboard: bool = True, progress: bool = True,
                 total_steps: int = 0, start_step: int = 0, enabled: bool = True,
                 wandb: dict[str, Any] | None = None) -> None:
        self.dir = Path(log_dir)
        self.enabled = enabled
        self.path = self.dir / "metrics.jsonl"
        self.total_steps = total_steps
        self._tb = None
        self._bar = None
        self._wandb = None
        self.history: list[dict[str, Any]] = []
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._truncate(start_step)
        if wandb and wandb.get("project") and wandb.get("mode") != "disabled":
            self._wandb = _start_wandb(self.dir, wandb)
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
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=step)
        scores = eval_line(step, metrics)
        if scores is not None:
            log.info("%s", scores)
        if self._bar is None:
            log.info("%s", step_line(step, self.total_steps, metrics))
        else:
            self._bar.set_postfix({short: f"{metrics[k]:.3g}" for k, short in PROGRESS_KEYS
                                   if metrics.get(k) is not None}, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
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


def _start_wandb(log_dir: Path, opts: dict[str, Any]):
    """A W&B run writing under log_dir/wandb; ValueError when wandb is not installed."""
    try:
        import wandb
    except ImportError:
        raise ValueError('config key \'log.wandb.project\': W&B logging needs wandb (pip install -e ".[wandb]")') from None
    return wandb.init(project=opts["project"], name=opts.get("name") or log_dir.name, mode=opts.get("mode", "online"),
                      dir=str(log_dir), config=opts.get("config"), reinit="finish_previous")


def _finite_or_none(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
