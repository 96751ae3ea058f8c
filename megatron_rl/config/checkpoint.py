"""The `checkpoint` section: saving, resuming, retention and the best checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.config.eval import eval_metric_names

if TYPE_CHECKING:
    from megatron_rl.config.run import RunConfig


@dataclass
class CheckpointConfig:
    save_every: int = 0
    """Steps between checkpoints (0 = only at the end when `save_final`)."""
    save_final: bool = True
    resume: bool | str = "auto"
    """What a launch does with a log.dir that already holds a run (its config.yaml, metrics or
    checkpoints; loop/run_folder.py): auto = resume it from its latest checkpoint when its saved
    config is compatible (same model, precision, algorithm, data and reward: RUN_IDENTITY there), else
    refuse naming what differs; a folder without a run starts one. true (`--resume`) = the same, with
    a warning when there is nothing to resume. false = always start afresh, so a folder holding a run
    is refused. verl's trainer.resume_mode (auto | disable)."""
    overwrite: bool = False
    """`--overwrite`: delete the run in log.dir (metrics, checkpoints with latest / best, config,
    samples, exports) and start afresh. Never with resume=true."""
    async_save: bool = False
    """Write the model/optimizer checkpoint in a background process (Megatron's async save); it
    is published (renamed, `latest` moved) once written everywhere, always before the next save
    and the end of the run."""
    keep_best: str = ""
    """`<eval name>/<metric>` (e.g. `math500/avg@4`, `heldout/bf16/pass@1`): the checkpointed step
    whose weights scored highest on that eval metric is named by the file `best` in the checkpoint
    folder (as `latest` names the newest); retention never deletes it. Empty: off. Higher is better.
    Only checkpointed weights compete: evaluate on the steps you save (docs/eval.md)."""
    keep_last: int = 3
    """Keep only the newest N complete checkpoints (older ones are deleted after each save; the
    one `latest` names, the one a `best` file names and any being written are never deleted).
    0 = keep all. 3: the newest plus two to fall back on (a checkpoint with Adam state is ~14 bytes
    per parameter, ~110 GB at 8B, so keep-all over 500 steps saved every 50 is ~1.1 TB; three is
    ~330 GB, and `best` is kept besides)."""
    save_hf_every: int = 0
    """Steps between HF safetensors exports (log.dir/hf/step_XXXXXX: config, tokenizer, weights;
    loadable by transformers and SGLang). 0 = off."""


CHOICES: dict[str, tuple] = {}
POSITIVE: tuple[str, ...] = ()


def check_retention(c: CheckpointConfig) -> None:
    for key in ("keep_last", "save_hf_every"):
        if getattr(c, key) < 0:
            raise ValueError(f"config key 'checkpoint.{key}': must be >= 0, got {getattr(c, key)}")
    if c.resume not in (True, False, "auto"):
        raise ValueError(f"config key 'checkpoint.resume': expected auto, true or false, got {c.resume!r}")
    if c.overwrite and c.resume is True:
        raise ValueError("config key 'checkpoint.overwrite': deletes the run that checkpoint.resume=true "
                         "(--resume) asks to continue; give one of them")


def check_keep_best(cfg: RunConfig) -> None:
    target = cfg.checkpoint.keep_best
    if not target:
        return
    name, _, metric = target.partition("/")
    metric = metric.removeprefix("bf16/")
    datasets = {d.name: d for d in cfg.eval.datasets}
    if name not in datasets or metric not in eval_metric_names(datasets[name]):
        known = [f"{d.name}/{m}" for d in cfg.eval.datasets for m in eval_metric_names(d)]
        raise ValueError(f"config key 'checkpoint.keep_best': {target!r} is not an eval metric of this "
                         f"run (eval.datasets give: {known})")
    if target.startswith(f"{name}/bf16/") and cfg.eval.precision == "rollout":
        raise ValueError(f"config key 'checkpoint.keep_best': {target!r} needs eval.precision bf16 or both")
    if target.count("/") == 1 and cfg.eval.precision == "bf16":
        raise ValueError(f"config key 'checkpoint.keep_best': eval.precision=bf16 logs {name}/bf16/{metric}")
