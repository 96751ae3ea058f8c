"""The `log` section: the log folder, TensorBoard, W&B (log.wandb), progress and sample dumps."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field


@dataclass
class WandbConfig:
    """Weights & Biases logging (pip install -e ".[wandb]"), the same metric keys as TensorBoard."""

    project: str = ""
    """W&B project; empty = W&B off."""
    name: str = ""
    """Run name; empty = the name of log.dir."""
    mode: str = "online"
    """online | offline (writes log.dir/wandb, no network; `wandb sync` uploads later) | disabled."""


@dataclass
class LogConfig:
    dir: str = "runs/default"
    tensorboard: bool = True
    progress: bool = True
    """A progress bar; off, every step logs one summary line instead (what a Slurm log shows)."""
    plot: bool = True
    dump_samples_every: int = 0
    """Write samples/step_XXXXXX.jsonl every this many steps (prompt, response, reward and its
    components, advantage, length, finish reason; verl's rollout_data_dir). 0 = off."""
    dump_samples_num: int = 16
    """Samples per dump: the first ones of the log rank's share of the step."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


CHOICES = {"wandb.mode": ("online", "offline", "disabled")}
POSITIVE: tuple[str, ...] = ()


def check_log(log: LogConfig) -> None:
    if log.dump_samples_every < 0:
        raise ValueError(f"config key 'log.dump_samples_every': must be >= 0, got {log.dump_samples_every}")
    if log.dump_samples_num < 1:
        raise ValueError(f"config key 'log.dump_samples_num': must be >= 1, got {log.dump_samples_num}")
    if log.wandb.project and log.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ValueError('config key \'log.wandb.project\': W&B logging needs wandb (pip install -e ".[wandb]")')
