"""Held-out evaluation through the run's own rollout engine: sharded over DP, scored, reduced (docs/eval.md)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_rl import collectives
from megatron_rl.config import eval_metric_names
from megatron_rl.data.prompt_file import check_prompt_file
from megatron_rl.loop import build
from megatron_rl.loop.phases import _broadcast_from_engine_rank, _step_seed
from megatron_rl.loop.sampling import response_texts, sampling_params, score_texts

log = logging.getLogger("megatron_rl.loop.evaluate")

DEFAULT_TASK_EXAMPLES = 256  # problems drawn for a built-in task when max_examples is 0
HELDOUT_SEED_OFFSET = 7_919  # built-in eval sets draw with train.seed + this (training: seed, SFT: seed + 1)
EVAL_SALT = 11  # + dataset index: salt of the per-step evaluation seed (rollouts salt with their DP rank)


@dataclass
class EvalSet:
    """One dataset ready to score: its config, prompts, reward, extractor and format check."""

    cfg: Any  # config.EvalDatasetConfig
    prompts: list  # data.datasets.PromptItem, every problem (each DP rank takes a stride)
    reward: str  # a reward name; "" = reward.url
    extractor: Callable[[str], str | None] | None
    valid_format: Callable[[str], bool] | None
    metrics: list[str]


def held_out_records(cfg, task: str, count: int) -> list[dict[str, str]]:
    """`count` prompts of a built-in task, none of which the run trains or warm-starts on."""
    from megatron_rl.data.tasks import make_task_dataset

    seen = set()
    if not cfg.data.path and cfg.data.task == task:
        seen = {r["prompt"] for r in make_task_dataset(task, cfg.data.num_examples, seed=cfg.train.seed)}
        sft = cfg.train.sft_steps * cfg.train.sft_batch_size
        if sft:
            seen |= {r["prompt"] for r in make_task_dataset(task, sft, seed=cfg.train.seed + 1)}
    drawn = make_task_dataset(task, 4 * count + len(seen), seed=cfg.train.seed + HELDOUT_SEED_OFFSET)
    unique = list({r["prompt"]: r for r in drawn if r["prompt"] not in seen}.values())
    if len(unique) < count:
        raise ValueError(f"task {task!r} has only {len(unique)} held-out prompts, {count} asked (eval max_examples)")
    return unique[:count]


def _check_eval_file(path: Path, prompt_key: str, answer_key: str, key: str) -> None:
    """The file exists, holds rows and has the training data's prompt and answer keys (dotted keys
    reach nested fields). Checked when a run or `megatron-rl eval` starts (loop/preflight.py), not
    at config load: `plan` and `launch --dry-run` read recipes on machines without the data."""
    check_prompt_file(path, {"data.prompt_key": prompt_key, "data.answer_key": answer_key}, key)


def build_eval_sets(cfg, tokenizer) -> list[EvalSet]:
    """Every eval.datasets entry as an EvalSet; ValueError naming the key on a bad task or reward."""
    from megatron_rl.data.tasks import get_task
    from megatron_rl.rewards import get_answer_extractor, get_reward_fn

    sets = []
    for i, d in enumerate(cfg.eval.datasets):
        key = f"eval.datasets[{i}]"
        try:
            spec = get_task(d.task) if d.task else None
            run_reward = "" if cfg.reward.url else build.reward_name(cfg)  # "": the run's remote reward
            reward = d.reward or cfg.reward.name or (spec.reward_fn if spec else run_reward)
            if reward:
                get_reward_fn(reward)
        except ValueError as err:
            raise ValueError(f"config key '{key}.{'reward' if d.reward else 'task'}': {err}") from None
        if d.path:
            _check_eval_file(Path(d.path), cfg.data.prompt_key, cfg.data.answer_key, f"{key}.path")
        if spec is not None:
            records = held_out_records(cfg, d.task, d.max_examples or DEFAULT_TASK_EXAMPLES)
            items = build.read_prompts(cfg.data, tokenizer, records=records)
        else:
            items = build.read_prompts(cfg.data, tokenizer, d.path)
        prompts = list(items)[: d.max_examples or None]
        sets.append(EvalSet(d, prompts, reward, get_answer_extractor(reward),
                            spec.valid_format if spec else None, eval_metric_names(d)))
    return sets


class Evaluator:
    """Scores the engine's current weights on every eval set; collective over the world."""

    def __init__(self, run, sets: list[EvalSet]) -> None:
        self.run = run
        self.sets = sets
        self.runners: dict[str, Any] = {}
        self._bf16 = None  # (engine or None, WeightSync), made at the first BF16 evaluation
        self.results: dict[str, dict] = {}  # per dataset: the last evaluation's numbers (eval_results.json)

    @classmethod
    def build(cls, run) -> "Evaluator | None":
        if not run.cfg.eval.datasets:
            return None
        return cls(run, build_eval_sets(run.cfg, run.tokenizer))

    def due(self, step: int) -> bool:
        """At the top of `step` (before its rollout)."""
        e = self.run.cfg.eval
        return (step == 0 and e.at_start) or bool(e.every and step > 0 and step % e.every == 0)

    def evaluate(self, step: int, memory=None, dump_dir: Path | None = None) -> dict[str, float]:
        """eval/<name>/... metrics of the weights the engine holds; every rank calls it."""
        t0 = time.perf_counter()
        precision, out = self.run.cfg.eval.precision, {}
        if precision in ("rollout", "both"):
            out.update(self._all_sets(self.run.engine, "", step, dump_dir))
        if precision in ("bf16", "both"):
            out.update(self._all_sets(self._bf16_engine(memory), "bf16/", step, dump_dir))
        if precision == "both":
            out.update(_differences(out))
        out["time/eval"] = time.perf_counter() - t0
        return out

    def _all_sets(self, engine, prefix: str, step: int, dump_dir: Path | None) -> dict[str, float]:
        out = {}
        for index, s in enumerate(self.sets):
            t0 = time.perf_counter()
            rows, failures = self._score_shard(engine, s, _step_seed(self.run.cfg.train.seed, step, EVAL_SALT + index))
            named = _reduce(self.run, s, rows, failures)
            named["time"] = time.perf_counter() - t0
            out.update({f"eval/{s.cfg.name}/{prefix}{k}": v for k, v in named.items()})
            self.results.setdefault(s.cfg.name, {"k": s.cfg.n_samples, "n_problems": len(s.prompts)})
            self.results[s.cfg.name].update({f"{prefix}metrics": {k: v for k, v in named.items() if k != "time"},
                                             f"{prefix}seconds": named["time"]})
            if self.run.cfg.eval.dump_samples and dump_dir is not None:
                _dump(self.run, rows, dump_dir / f"step_{step:06d}_{s.cfg.name}{'_bf16' if prefix else ''}.jsonl")
        return out

    def _score_shard(self, engine, s: EvalSet, seed: int) -> tuple[list[dict], list[int]]:
        """This DP rank's problems (a stride), generated and scored on the engine rank and
        broadcast to its model-parallel peers (phases does the same for rollouts), with the
        reward's [errors, timeouts] over them."""
        run = self.run
        shard = s.prompts[run.parallel.dp_rank::run.parallel.dp_size]
        scored = self._generate_and_score(engine, s, shard, seed) if run.is_engine_rank else None
        return _broadcast_from_engine_rank(scored, run.parallel, run.host_groups)

    def _generate_and_score(self, engine, s: EvalSet, shard: list, seed: int) -> tuple[list[dict], list[int]]:
        """The rollout path (loop/sampling.py) with the dataset's sampling overrides."""
        if not shard:
            return [], [0, 0]
        d, n, run = s.cfg, s.cfg.n_samples, self.run
        sampling = sampling_params(run.cfg.rollout, run.tokenizer.eos_token_id, n=n, seed=seed,
                                   overrides=eval_overrides(d))
        samples = engine.generate([p.prompt_ids for p in shard], sampling)
        texts = response_texts(run.tokenizer, samples, sampling.stop)
        rewards, stats = score_texts(self._runner(s.reward), shard, texts, n)
        preds = stats.get("preds") or [s.extractor(t) if s.extractor else None for t in texts]
        rows = [_problem_row(p, samples[i * n:(i + 1) * n], texts[i * n:(i + 1) * n], rewards[i * n:(i + 1) * n],
                             preds[i * n:(i + 1) * n], s.valid_format) for i, p in enumerate(shard)]
        return rows, [stats["num_errors"], stats["num_timeouts"]]

    def _runner(self, name: str):
        if name not in self.runners:
            self.runners[name] = build.build_rewards(self.run.cfg, name)
        return self.runners[name]

    def _bf16_engine(self, memory):
        """The same weights without rollout quantization: SGLang with rollout_quant=bf16 is already
        that engine; the torch engine gets a BF16 twin, synced from the trainer before each use."""
        run = self.run
        if run.cfg.rollout.engine == "sglang":
            return run.engine  # config validation allows bf16 / both here only when the servers run BF16
        if self._bf16 is None:
            self._bf16 = _bf16_twin(run)
        engine, sync = self._bf16
        with memory.trainer_on_device() if memory is not None else contextlib.nullcontext():
            sync.sync()
        return engine

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        if self._bf16 is not None and self._bf16[0] is not None:
            self._bf16[0].shutdown()


def _problem_row(prompt, samples, texts, rewards, preds, valid_format) -> dict:
    """One problem's n responses with what the metrics and the sample dump need."""
    return {"index": prompt.index, "prompt": prompt.prompt_text, "answer": prompt.answer, "responses": texts,
            "rewards": rewards, "preds": preds, "lengths": [len(x.response_ids) for x in samples],
            "truncated": [x.finish_reason == "length" for x in samples],
            "garbled": None if valid_format is None else [not valid_format(t) for t in texts]}


def _bf16_twin(run):
    """(TorchRolloutEngine without quantization or None off the engine rank, its WeightSync)."""
    from megatron_rl.fp8.rollout_quant import RolloutQuantSpec
    from megatron_rl.sync.weight_sync import WeightSync

    cfg = replace(run.cfg, precision=replace(run.cfg.precision, rollout_quant="bf16"))
    engine, transport = build.build_engine(cfg, run.checkpointer.hf_dir) if run.is_engine_rank else (None, None)
    return engine, WeightSync(run.actor, transport, RolloutQuantSpec.from_config(cfg.precision),
                              bucket_mb=cfg.sync.bucket_size_mb)


def eval_overrides(d) -> dict[str, Any]:
    """An eval dataset's sampling knobs (config.EvalDatasetConfig) over the rollout section's: its
    own temperature and top_p always, the others where set (None: the rollout's)."""
    return {"temperature": d.temperature, "top_p": d.top_p, "max_new_tokens": d.max_new_tokens or None,
            "top_k": d.top_k, "min_p": d.min_p, "stop": d.stop, "stop_token_ids": d.stop_token_ids,
            "repetition_penalty": d.repetition_penalty}


def _reduce(run, s: EvalSet, rows: list[dict], failures: list[int]) -> dict[str, float]:
    """Dataset metrics over every DP rank's problems: per-problem scores and per-sample counts
    summed over the data-parallel group (one all-reduce), the longest response by a max.
    failures: this rank's [reward errors, reward timeouts], summed too."""
    from megatron_rl.algo.eval_metrics import problem_scores

    has_preds = s.extractor is not None or any(p is not None for r in rows for p in r["preds"])
    sums = dict.fromkeys(s.metrics, 0.0)
    for r in rows:
        for name, value in problem_scores(s.metrics, r["rewards"], r["preds"] if has_preds else None).items():
            sums[name] += value
    samples = [(n, t, g) for r in rows
               for n, t, g in zip(r["lengths"], r["truncated"], r["garbled"] or [False] * len(r["lengths"]))]
    local = [*sums.values(), float(len(rows)), *(float(sum(x[j] for x in samples)) for j in range(3)),
             float(len(samples)), *map(float, failures), float(has_preds)]
    total = run.parallel.dp_reducer()(torch.tensor(local, dtype=torch.float64)).tolist()  # DP group
    longest = torch.tensor([max((x[0] for x in samples), default=0)], dtype=torch.float64)
    longest = collectives.all_reduce(longest, run.parallel.dp_group, op="max")  # DP group
    problems, n_samples = max(total[len(sums)], 1.0), max(total[len(sums) + 4], 1.0)
    out = {name: total[i] / problems for i, name in enumerate(sums)
           if not name.startswith("maj@") or total[-1] > 0}
    out["response_length/mean"] = total[len(sums) + 1] / n_samples
    out["response_length/max"] = float(longest[0])
    out["truncated_rate"] = total[len(sums) + 2] / n_samples
    if s.valid_format is not None:
        out["garbled_rate"] = total[len(sums) + 3] / n_samples
    out["reward_errors"], out["reward_timeouts"] = total[len(sums) + 5], total[len(sums) + 6]
    return out


def _differences(out: dict[str, float]) -> dict[str, float]:
    """eval/<name>/rollout_minus_bf16/<metric> for every metric logged in both precisions."""
    diffs = {}
    for key, value in out.items():
        head, _, metric = key.partition("/bf16/")
        if metric and metric != "time" and f"{head}/{metric}" in out:
            diffs[f"{head}/rollout_minus_bf16/{metric}"] = out[f"{head}/{metric}"] - value
    return diffs


def _dump(run, rows: list[dict], path: Path) -> None:
    """Every problem of every DP replica to one JSONL file on rank 0 (world gather; model-parallel
    peers hold copies of their engine rank's rows and send none)."""
    gathered = collectives.gather_objects(rows if run.is_engine_rank else [], 0, None)
    if gathered is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted((r for part in gathered for r in part), key=lambda r: r["index"])
    with path.open("w") as f:
        for r in ordered:
            f.write(json.dumps(r) + "\n")


def checkpoint_folder(path: str | Path) -> tuple[Path, int]:
    """(step folder, step) of `path`: a step folder (with model/), a checkpoints folder (its
    `latest`), or a marker file in one (`latest`, `best`)."""
    path = Path(path)
    if path.is_file() and path.name in ("latest", "best"):
        path = path.parent / f"step_{int(path.read_text().strip()):06d}"
    elif path.is_dir() and not (path / "model").is_dir() and (path / "latest").is_file():
        path = path / f"step_{int((path / 'latest').read_text().strip()):06d}"
    if not (path / "model").is_dir():
        raise ValueError(f"--checkpoint {path}: not a checkpoint (no model/ folder; expected a step folder, "
                         "a checkpoints folder with `latest`, or its `latest` / `best` file)")
    name = path.name.removeprefix("step_")
    return path, int(name) if name.isdigit() else 0


def evaluate_checkpoint(cfg, checkpoint: str = "", output: str = "") -> dict:
    """`megatron-rl eval`: score a checkpoint (or model.hf_dir / the tiny model alone) on
    cfg.eval.datasets; writes <output>/eval_results.json (and the sample dumps) and returns it.

    output defaults to `<log.dir>_eval`, never log.dir itself: the run's metrics stay untouched."""
    if not cfg.eval.datasets:
        raise ValueError("config key 'eval.datasets': `megatron-rl eval` needs at least one dataset")
    folder, step = checkpoint_folder(checkpoint) if checkpoint else (None, 0)
    out_dir = Path(output or f"{cfg.log.dir.rstrip('/')}_eval")
    cfg = replace(cfg, log=replace(cfg.log, dir=str(out_dir), tensorboard=False, progress=False, plot=False),
                  checkpoint=replace(cfg.checkpoint, resume=False, keep_best=""))
    run = build.build_run(cfg)
    evaluator = None
    try:
        if folder is not None:
            run.actor.load_checkpoint(folder / "model", model_only=True)
        run.sync.sync()
        evaluator = Evaluator.build(run)
        evaluator.evaluate(step, dump_dir=out_dir / "eval_samples")
        results = {"checkpoint": str(folder) if folder else (cfg.model.hf_dir or cfg.model.gguf or "tiny built-in model"),
                   "step": step, "precision": cfg.eval.precision, "rollout_quant": cfg.precision.rollout_quant,
                   "datasets": evaluator.results}
        if run.is_log_rank:
            (out_dir / "eval_results.json").write_text(json.dumps(results, indent=1))
            log.info("eval results written to %s", out_dir / "eval_results.json")
    finally:
        if evaluator is not None:
            evaluator.close()
        run.finish()
    return results
