"""What a launch does with its log folder: start a run, resume the one there, refuse, or overwrite it.

A folder holds a run when it has a config.yaml, a non-empty metrics.jsonl or a checkpoints folder.
`checkpoint.resume`:

- auto (default) or true (`--resume`, older recipes): resume the run from its latest checkpoint
  when its saved config.yaml agrees with this launch on RUN_IDENTITY (a run without a checkpoint
  restarts from step 0 in place); refuse, naming each key that differs, when it does not. A folder
  without a run starts one (true: with a warning, in case log.dir is mistyped).
- false: start afresh; a folder holding a run is refused.

`checkpoint.overwrite` (`--overwrite`) deletes the old run's files (RUN_FILES) first, so nothing
of it (metrics lines, checkpoints, `latest`, `best`, samples) can be read as the new run's.
Everything here runs before the actor or a server is built; a refusal changes no file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config import RunConfig

log = logging.getLogger("megatron_rl.loop.run_folder")

RUN_IDENTITY = (
    "model",  # the weights: HF folder, Megatron checkpoint, tiny architecture, planted outliers
    "precision",  # the train recipe, FP8 format, rollout quantization, scales
    "calib.enabled", "algo.advantage_estimator", "algo.loss_mode",
    "data.path", "data.task", "data.prompt_key", "data.answer_key",
    "reward.name", "reward.url",
)
"""Config keys (a section: every key in it) whose change makes a run another run. The rest
(train.num_steps, lr, batch sizes, parallel layout, eval, logging) may change on a resume, as a
checkpoint loads at any TP / PP / DP and a longer run continues a shorter one."""

RUN_FILES = ("metrics.jsonl", "checkpoints", "config.yaml", "actor_settings.json", "tb", "samples",
             "eval_samples", "hf", "curves.png", "wandb", "sglang", "rollout_fp8")
"""What a run writes under log.dir; `--overwrite` deletes these and nothing else."""


def holds_run(log_dir: Path) -> bool:
    metrics = log_dir / "metrics.jsonl"
    return ((log_dir / "config.yaml").is_file() or (log_dir / "checkpoints").is_dir()
            or (metrics.is_file() and metrics.stat().st_size > 0))


def finished_steps(cfg: RunConfig) -> int | None:
    """The steps a resumed run has done when they reach train.num_steps (nothing left to train),
    else None. Call with checkpoint.resume resolved (prepare_log_dir)."""
    marker = Path(cfg.log.dir) / "checkpoints" / "latest"
    text = marker.read_text().strip() if cfg.checkpoint.resume is True and marker.is_file() else ""
    return int(text) if text.isdigit() and int(text) >= cfg.train.num_steps else None


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def differences(saved: dict, now: dict) -> list[str]:
    """`key: saved -> now` for every RUN_IDENTITY key whose value differs (keys an older config.yaml
    lacks are not compared)."""
    old, new = _flatten(saved), _flatten(now)
    out = []
    for key in sorted(new):
        identity = any(key == k or key.startswith(k + ".") for k in RUN_IDENTITY)
        if identity and key in old and old[key] != new[key]:
            out.append(f"{key}: {json.dumps(old[key], default=str)} -> {json.dumps(new[key], default=str)}")
    return out


def decide(cfg: RunConfig) -> str:
    """`start`, `resume` or `overwrite` for cfg.log.dir as it is now; ValueError on a refusal.
    Reads only: every rank may call it."""
    c, log_dir = cfg.checkpoint, Path(cfg.log.dir)
    if not holds_run(log_dir):
        if c.resume is True:
            log.warning("checkpoint.resume=true: log.dir %s holds no run to resume; starting one", log_dir)
        return "start"
    if c.overwrite:
        return "overwrite"
    hint = "pass --overwrite (checkpoint.overwrite=true) to delete it, or choose another log.dir"
    if c.resume is False:
        raise ValueError(f"config key 'checkpoint.resume': false, but log.dir {log_dir} holds a run; {hint}")
    saved = log_dir / "config.yaml"
    diff = differences(yaml.safe_load(saved.read_text()) or {}, cfg.to_dict()) if saved.is_file() else []
    if diff:
        raise ValueError(f"log.dir {log_dir} holds another run (its config.yaml differs: {'; '.join(diff)}); "
                         f"{hint}")
    return "resume"


def clear_run(log_dir: Path) -> list[str]:
    """Delete RUN_FILES under log_dir; returns the names deleted. Each is first renamed into one
    hidden trash folder (a rename is atomic), so a kill midway leaves no half-deleted checkpoint
    under its own name; a trash folder left by a kill is deleted by the next call."""
    trash = log_dir / f".overwritten_{os.getpid()}_{time.time_ns()}"
    moved = []
    for name in RUN_FILES:
        if (log_dir / name).exists():
            trash.mkdir(exist_ok=True)
            os.replace(log_dir / name, trash / name)
            moved.append(name)
    for old in log_dir.glob(".overwritten_*"):
        shutil.rmtree(old, ignore_errors=True)
    return moved


def prepare_log_dir(cfg: RunConfig, rank: int) -> RunConfig:
    """Apply the decision for cfg.log.dir: rank 0 clears an overwritten run. Returns cfg with
    checkpoint.resume resolved to true or false (what build_run and the checkpointer read).
    Collective-free, before the process group exists: a rank that reads after rank 0's deletion sees
    no run and starts afresh, as the others do; nothing writes into log.dir before init_parallel,
    a rendezvous of every rank, so no rank reads the new run's files as an old run."""
    action = decide(cfg)
    if action == "overwrite" and rank == 0:
        log.warning("checkpoint.overwrite: deleted the run in %s (%s)", cfg.log.dir,
                    ", ".join(clear_run(Path(cfg.log.dir))))
    if action == "resume" and rank == 0:
        log.info("log.dir %s holds a compatible run: resuming it (checkpoint.resume=%s)",
                 cfg.log.dir, str(cfg.checkpoint.resume).lower())
    return replace(cfg, checkpoint=replace(cfg.checkpoint, resume=action == "resume", overwrite=False))
