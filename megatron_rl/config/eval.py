"""The `eval` section: held-out evaluation sets, their sampling, metrics and schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config.rollout import check_sampling_knobs

if TYPE_CHECKING:
    from megatron_rl.config.run import RunConfig


EVAL_PRECISIONS = ("rollout", "bf16", "both")
_EVAL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass
class EvalDatasetConfig:
    """One held-out evaluation set (docs/eval.md): prompts as the training data reads them."""

    name: str = ""
    """Short name: metrics are logged as eval/<name>/<metric>. Letters, digits, '_', '-', '.'."""
    path: str = ""
    """Prompt file (.jsonl or .parquet) with data.prompt_key and data.answer_key, formatted as the
    training prompts (the same dataset code). Empty: the built-in `task`."""
    task: str = ""
    """Built-in task (sort | reverse | add | chain | word_math) when `path` is empty; its prompts are drawn with a
    seed of their own and the training prompts are removed, so the set is held out."""
    n_samples: int = 1
    """Responses per problem (n >= every k of `metrics`)."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy (argmax), the usual pass@1 of a deterministic decode."""
    top_p: float = 1.0
    max_new_tokens: int = 0
    """Response length cap in tokens; 0 = rollout.max_new_tokens."""
    top_k: int | None = None
    """null = rollout.top_k; the other sampling knobs below alike: null takes the rollout's."""
    min_p: float | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    reward: str = ""
    """Reward function name (rewards.get_reward_fn); empty = the run's (reward.name, else the task's)."""
    max_examples: int = 0
    """Problems to evaluate: the first N of the file; for a built-in task, how many to draw (0: 256).
    0 with a path: every row."""
    metrics: list[str] = field(default_factory=list)
    """avg@k | pass@k | maj@k with k <= n_samples. Empty: avg@n, pass@n and maj@n (n = n_samples);
    maj@k needs an answer extractor (built-in rewards, or a user reward's dict `pred`)."""


@dataclass
class EvalConfig:
    """Held-out evaluation during training and by `megatron-rl eval` (docs/eval.md); names follow
    verl (test_freq, val_before_train) and NeMo-RL (val_period, val_at_start)."""

    every: int = 0
    """Evaluate every N steps, at the top of the step (before its rollout); 0 = never periodically."""
    at_start: bool = False
    """Evaluate at the top of step 0, before any update (verl's val_before_train)."""
    at_end: bool = False
    """Evaluate after the last step, before its checkpoint; joins that step's metrics."""
    precision: str = "rollout"
    """rollout (the engine as it samples rollouts) | bf16 (the same weights through a BF16 engine, no
    W8A8 / W4A4 emulation; torch engine only) | both (both, and eval/<name>/rollout_minus_bf16/<m>)."""
    dump_samples: bool = False
    """Write every prompt, response, reward and extracted answer to eval_samples/ under log.dir
    (training) or next to eval_results.json (`megatron-rl eval`)."""
    datasets: list[EvalDatasetConfig] = field(default_factory=list)
    """The evaluation sets; empty = evaluation off."""


CHOICES: dict[str, tuple] = {}
POSITIVE: tuple[str, ...] = ()


def check_eval(cfg: RunConfig) -> None:
    """The eval section: schedule, precision, every dataset (checkpoint.keep_best: checkpoint.py)."""
    e = cfg.eval
    if e.every < 0:
        raise ValueError(f"config key 'eval.every': must be >= 0 (0 = never), got {e.every}")
    if e.precision not in EVAL_PRECISIONS:
        raise ValueError(f"config key 'eval.precision': {e.precision!r} is not one of {list(EVAL_PRECISIONS)}")
    if e.precision != "rollout" and cfg.rollout.engine == "sglang" and cfg.precision.rollout_quant != "bf16":
        raise ValueError(f"config key 'eval.precision': {e.precision!r} needs a BF16 engine next to the FP8 "
                         "servers; with rollout.engine=sglang that is a second (BF16) server set, which this "
                         "version does not start: use 'rollout', or score a checkpoint with `megatron-rl eval` "
                         "and precision.rollout_quant=bf16 (docs/eval.md)")
    names = set()
    for i, d in enumerate(e.datasets):
        _check_dataset(cfg, d, f"eval.datasets[{i}]")
        if d.name in names:
            raise ValueError(f"config key 'eval.datasets[{i}].name': {d.name!r} is used twice")
        names.add(d.name)


def eval_metric_names(d: EvalDatasetConfig) -> list[str]:
    """The dataset's metrics, defaults resolved (avg@n, pass@n, maj@n)."""
    n = d.n_samples
    return list(d.metrics) or [f"avg@{n}", f"pass@{n}", f"maj@{n}"]


def _check_dataset(cfg: RunConfig, d: EvalDatasetConfig, key: str) -> None:
    from megatron_rl.algo.eval_metrics import parse_metric

    if not d.name or not set(d.name) <= _EVAL_NAME_CHARS:
        raise ValueError(f"config key '{key}.name': {d.name!r} must be non-empty letters, digits, '_', '-', '.'")
    if bool(d.path) == bool(d.task):
        raise ValueError(f"config key '{key}.path': give exactly one of path (a .jsonl / .parquet file) or task")
    if d.n_samples < 1:
        raise ValueError(f"config key '{key}.n_samples': must be >= 1, got {d.n_samples}")
    for field_name in ("max_new_tokens", "max_examples", "temperature"):
        if getattr(d, field_name) < 0:
            raise ValueError(f"config key '{key}.{field_name}': must be >= 0, got {getattr(d, field_name)}")
    if not 0.0 < d.top_p <= 1.0:
        raise ValueError(f"config key '{key}.top_p': must be in (0, 1], got {d.top_p}")
    check_sampling_knobs(d, key)
    if cfg.rollout.engine == "sglang" and (d.min_p or 0.0) > 0 and cfg.rollout.sglang.deterministic_inference:
        raise ValueError(f"config key '{key}.min_p': SGLang's seeded (deterministic) sampler does not support "
                         "min_p; leave it unset (or 0) or set rollout.sglang.deterministic_inference=false")
    for name in eval_metric_names(d):
        try:
            _, k = parse_metric(name)
        except ValueError as err:
            raise ValueError(f"config key '{key}.metrics': {err}") from None
        if k > d.n_samples:
            raise ValueError(f"config key '{key}.metrics': {name!r} needs k={k} <= {key}.n_samples={d.n_samples}")
    if d.path and Path(d.path).suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"config key '{key}.path': {d.path} is neither .jsonl nor .parquet")
