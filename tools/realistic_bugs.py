"""Hand-written realistic bugs (not mutation operators): each is applied alone, its mapped test files
run, and the source restored (always: try/finally, then `git diff` checked clean).

    python tools/realistic_bugs.py                 # every bug -> realistic_bugs.json
    python tools/realistic_bugs.py --only b03 b07  # some
    python tools/realistic_bugs.py --list

A bug is caught when any of its mapped test files fails. Only those files run (a targeted subset), so
a bug that only some other test would catch counts as missed. `round` says when the bug was
written: before the tests of issue 42 ("before"), after the first of them ("after"), or after all of
them ("third").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
U = "tests/unit/"


@dataclass(frozen=True)
class Bug:
    id: str
    round: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str
    new_tests: tuple[str, ...] = ()
    """Test files added by issue 42 that also cover this code (`--old-tests-only` leaves them out)."""


BUGS = [
    # ---- written before the tests -------------------------------------------------------------
    Bug("b01", "before", "megatron_rl/algo/advantages.py",
        "baseline = (total - grouped) / (group_size - 1)", "baseline = (total - grouped) / group_size",
        (U + "test_algo_advantages.py",), "RLOO baseline divides by G instead of G - 1"),
    Bug("b02", "before", "megatron_rl/algo/advantages.py",
        "adv = adv / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)",
        "adv = adv / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)",
        (U + "test_algo_advantages.py",), "GRPO normalises by the population std, not the unbiased one"),
    Bug("b03", "before", "megatron_rl/algo/advantages.py",
        "var = (total_sq - count * mean * mean) / (count - 1)", "var = (total_sq - count * mean * mean) / count",
        (U + "test_algo_advantages.py",), "REINFORCE++ whitening uses the biased variance"),
    Bug("b04", "before", "megatron_rl/algo/advantages.py",
        "penalty = -exceed.clamp(min=0.0, max=float(buffer_len)) / buffer_len * penalty_factor",
        "penalty = -exceed.clamp(min=0.0, max=float(buffer_len)) / max_response_len * penalty_factor",
        (U + "test_algo_advantages.py",), "overlong penalty ramp divided by max_response_len instead of buffer_len"),
    Bug("b05", "before", "megatron_rl/algo/eval_metrics.py",
        "return sum(_answer_reward(a, answers[:k], rewards[:k]) for a in tied) / len(tied)",
        "return _answer_reward(tied[0], answers[:k], rewards[:k])",
        (U + "test_eval_metrics.py",), "maj@k tie broken by the first answer seen instead of the mean"),
    Bug("b06", "before", "megatron_rl/algo/eval_metrics.py",
        "votes = Counter(a for a in answers[:k] if a is not None)",
        "votes = Counter(a for a in answers if a is not None)",
        (U + "test_eval_metrics.py",), "maj@k votes over all n samples, not the first k"),
    Bug("b07", "before", "megatron_rl/algo/eval_metrics.py",
        "sum(r >= PASS_THRESHOLD for r in rewards)", "sum(r > 0 for r in rewards)",
        (U + "test_eval_metrics.py",), "pass@k counts partial credit as a pass"),
    Bug("b08", "before", "megatron_rl/loop/best.py",
        'if self.best is not None and value <= self.best["value"]:',
        'if self.best is not None and value < self.best["value"]:',
        (U + "test_eval_bookkeeping.py",), "best checkpoint: an equal score replaces the older best"),
    Bug("b09", "before", "megatron_rl/loop/refill.py",
        "if algo.max_gen_batches and len(counts) >= algo.max_gen_batches:",
        "if algo.max_gen_batches and len(counts) > algo.max_gen_batches:",
        (U + "test_refill_plan.py",), "refill samples one round past algo.max_gen_batches"),
    Bug("b10", "before", "megatron_rl/loop/refill.py",
        "return mine, int(per_rank.max()) if len(per_rank) else 0, target - remaining",
        "return mine, int(per_rank[dp_rank]) if len(per_rank) else 0, target - remaining",
        (U + "test_refill_plan.py",), "refill pads each rank to its own count, not the most any rank takes"),
    Bug("b11", "before", "megatron_rl/loop/sampling.py",
        '"stop_token_ids": [eos_token_id, *knobs["stop_token_ids"]]',
        '"stop_token_ids": list(knobs["stop_token_ids"]) or [eos_token_id]',
        (U + "test_eval_sampling.py",), "eos dropped as a stop once stop_token_ids is set"),
    Bug("b12", "before", "megatron_rl/loop/sampling.py",
        "answers = [prompts[i // n].answer for i in range(len(texts))]",
        "answers = [prompts[i % len(prompts)].answer for i in range(len(texts))]",
        (U + "test_eval_sampling.py",), "answers interleaved instead of n contiguous per prompt"),
    Bug("b13", "before", "megatron_rl/rewards/dapo.py",
        "return normalize_answer(found[-1]) if found else INVALID",
        "return normalize_answer(found[0]) if found else INVALID",
        (U + "test_rewards_dapo.py",), "DAPO reward takes the first 'Answer:' instead of the last"),
    Bug("b14", "before", "megatron_rl/rewards/runner.py",
        "size = max(1, math.ceil(count / parts))", "size = max(1, count // parts)",
        (U + "test_rewards_pool.py",), "pool chunks floor-sized: more chunks than workers x CHUNKS_PER_WORKER"),
    Bug("b15", "before", "megatron_rl/rewards/runner.py",
        'stats["components"] = {n: [0.0 if r is None else r[1].get(n, 0.0) for r in results] for n in names}',
        'stats["components"] = {n: [r[1].get(n, 0.0) for r in done] for n in names}',
        (U + "test_rewards_runner.py", U + "test_rewards_pool.py"),
        "reward components listed for the scored items only: misaligned after a failure"),
    Bug("b16", "before", "megatron_rl/loop/run_folder.py",
        "return int(text) if text.isdigit() and int(text) >= cfg.train.num_steps else None",
        "return int(text) if text.isdigit() and int(text) > cfg.train.num_steps else None",
        (U + "test_run_folder.py",), "a run that reached num_steps exactly is not seen as finished"),
    Bug("b17", "before", "megatron_rl/loop/run_folder.py",
        "or (metrics.is_file() and metrics.stat().st_size > 0))", "or metrics.is_file())",
        (U + "test_run_folder.py",), "an empty metrics.jsonl counts as a run"),
    Bug("b18", "before", "megatron_rl/loop/preflight.py",
        'check_prompt_file(e.path, columns, f"{key}.path")', 'check_prompt_file(e.path, columns, "data.path")',
        (U + "test_preflight.py",), "a bad eval file's error names data.path"),
    Bug("b19", "before", "megatron_rl/data/loader.py",
        'random.Random(f"prompt-loader:{self.seed}:{epoch}").shuffle(order)',
        'random.Random(f"prompt-loader:{self.seed}").shuffle(order)',
        (U + "test_data_loader.py",), "every epoch in the same order"),
    Bug("b20", "before", "megatron_rl/data/loader.py",
        "self.batches_served = int(served)\n        self._order = self._epoch_order(self.epoch)",
        "self.batches_served = int(served)\n        self._order = self._epoch_order(0)",
        (U + "test_data_loader.py",), "a resumed loader uses epoch 0's order in a later epoch"),
    Bug("b21", "before", "megatron_rl/algo/metrics.py",
        "keys = sorted(summed)", "keys = list(summed)",
        (U + "test_algo_metrics.py",), "metric payload in dict order: ranks with another key order sum different metrics"),
    Bug("b22", "before", "megatron_rl/telemetry/stats.py",
        "<= observed * (1 + 1e-7))", "< observed)",
        (U + "test_stats.py",), "Fisher's test drops the tables as likely as the observed one (ties)"),
    Bug("b23", "before", "megatron_rl/cluster/memory.py",
        "embeddings = embedding * (2 if not spec.tie_word_embeddings and pp == 1 else 1)",
        "embeddings = embedding * (2 if not spec.tie_word_embeddings else 1)",
        (U + "test_memory_parts.py",), "untied output layer counted on every pipeline stage"),
    Bug("b24", "before", "megatron_rl/algo/loss_spec.py",
        "if not 0.0 <= s.clip_low < s.clip_high:", "if not 0.0 <= s.clip_low <= s.clip_high:",
        (U + "test_algo_loss_spec.py",), "LossSpec accepts clip_low == clip_high"),
    Bug("b25", "before", "megatron_rl/loop/evaluate.py",
        'out["response_length/mean"] = total[len(sums) + 1] / n_samples',
        'out["response_length/mean"] = total[len(sums) + 1] / problems',
        (U + "test_eval_sampling.py", "tests/e2e/test_eval.py"), "eval response length averaged per problem, not per sample"),
    Bug("b26", "before", "megatron_rl/loop/evaluate.py",
        "bool(e.every and step > 0 and step % e.every == 0)", "bool(e.every and (step + 1) % e.every == 0)",
        (U + "test_eval_sampling.py", U + "test_config_eval.py"), "eval.every off by one step"),
    Bug("b27", "before", "megatron_rl/loop/signals.py",
        "return _STOP.is_set() or bool(request and os.path.exists(request))",
        "return _STOP.is_set() or bool(request)",
        (U + "test_signals.py",), "the stop-request variable alone (no file) stops the run"),
    Bug("b28", "before", "megatron_rl/train.py",
        "if not collectives.broadcast_object(signals.stop_requested(), 0, None) or step + 1 >= run_.cfg.train.num_steps:",
        "if not signals.stop_requested() or step + 1 >= run_.cfg.train.num_steps:",
        ("tests/e2e/test_stop_request.py",), "stop request decided by each rank, not rank 0's view"),
]

V = {  # the value-test files by module
    "algo": (U + "test_values_algo.py",), "loop": (U + "test_values_loop.py",),
    "rd": (U + "test_values_rewards_data.py",), "dist": ("tests/dist/test_values_collective.py",),
}
NEW_TESTS = {
    "b01": V["algo"], "b02": V["algo"], "b03": V["algo"], "b04": V["algo"], "b05": V["algo"], "b06": V["algo"],
    "b07": V["algo"], "b08": V["loop"], "b09": V["loop"], "b10": V["loop"], "b11": V["loop"], "b12": V["loop"],
    "b13": V["rd"], "b14": V["rd"], "b15": V["rd"], "b16": V["loop"], "b17": V["loop"], "b18": V["loop"],
    "b19": V["rd"], "b20": V["rd"], "b21": V["algo"] + V["dist"], "b22": V["rd"], "b23": (),
    "b24": V["algo"], "b25": V["loop"] + V["dist"], "b26": V["loop"], "b27": V["loop"], "b28": V["dist"],
}
BUGS = [replace(b, new_tests=NEW_TESTS.get(b.id, ())) for b in BUGS]

AFTER: list[Bug] = [  # written after the tests of issue 42, not tailored to them
    Bug("a01", "after", "megatron_rl/rewards/runner.py",
        '_fail_head(worker, queue, stats, "num_timeouts", f"timed out',
        '_fail_head(worker, queue, stats, "num_errors", f"timed out',
        (U + "test_rewards_pool.py", U + "test_rewards_runner.py"), "a reward timeout counted as an error"),
    Bug("a02", "after", "megatron_rl/algo/eval_metrics.py", "if n - c < k:", "if n - c <= k:",
        (U + "test_eval_metrics.py", U + "test_values_algo.py"), "pass@k is 1 already when n - c == k"),
    Bug("a03", "after", "megatron_rl/loop/refill.py",
        "kept_groups = torch.nonzero(keep.view(-1, group_size).all(dim=1)).flatten()[:groups]",
        "kept_groups = torch.nonzero(keep.view(-1, group_size).all(dim=1)).flatten()",
        (U + "test_refill_plan.py", U + "test_values_loop.py"), "refill trains every kept group of the last round, not the planned count"),
    Bug("a04", "after", "megatron_rl/loop/run_folder.py",
        "if identity and key in old and old[key] != new[key]:", "if identity and old.get(key) != new[key]:",
        (U + "test_run_folder.py", U + "test_values_loop.py"), "a key an older config.yaml lacks refuses the resume"),
    Bug("a05", "after", "megatron_rl/loop/evaluate.py",
        'longest = collectives.all_reduce(longest, run.parallel.dp_group, op="max")',
        'longest = collectives.all_reduce(longest, run.parallel.dp_group, op="sum")',
        (U + "test_eval_sampling.py", U + "test_values_loop.py", "tests/dist/test_values_collective.py"),
        "eval's longest response summed over DP ranks"),
    Bug("a06", "after", "megatron_rl/data/loader.py",
        "return None if not self.num_epochs else self.num_epochs * len(self.dataset) // self.batch_size",
        "return None if not self.num_epochs else -(-self.num_epochs * len(self.dataset) // self.batch_size)",
        (U + "test_data_loader.py", U + "test_values_rewards_data.py"), "the last partial batch of num_epochs served"),
    Bug("a07", "after", "megatron_rl/telemetry/stats.py",
        "sum(rng.choices(b, k=len(b))) / len(b)", "sum(rng.choices(b, k=len(a))) / len(a)",
        (U + "test_stats.py", U + "test_values_rewards_data.py"), "bootstrap resamples arm b at arm a's size"),
    Bug("a08", "after", "megatron_rl/loop/sampling.py",
        'return {**prompt.extra, "prompt": prompt.prompt_text}', 'return {"prompt": prompt.prompt_text, **prompt.extra}',
        (U + "test_eval_sampling.py", U + "test_values_loop.py"), "a row column named prompt replaces the prompt text"),
    Bug("a09", "after", "megatron_rl/loop/best.py",
        "if value is None or not math.isfinite(value):", "if value is None:",
        (U + "test_eval_bookkeeping.py", U + "test_values_loop.py"), "a NaN eval score becomes the best checkpoint"),
    Bug("a10", "after", "megatron_rl/loop/signals.py", "    _STOP.clear()\n", "",
        (U + "test_signals.py", U + "test_values_loop.py"), "a SIGUSR1 of an earlier training stops the next one in the process"),
]
BUGS += AFTER

THIRD: list[Bug] = [  # a third round, written after every test of issue 42 was in (an out-of-sample check)
    Bug("c01", "third", "megatron_rl/algo/advantages.py",
        "return varied.repeat_interleave(group_size)", "return varied.repeat(group_size)",
        (U + "test_algo_advantages.py", U + "test_values_algo.py"), "dynamic sampling's keep mask tiled, not per group"),
    Bug("c02", "third", "megatron_rl/algo/metrics.py",
        'out["ess"] = min(w_mean * w_mean / w_sq, 1.0)', 'out["ess"] = min(w_mean / w_sq, 1.0)',
        (U + "test_algo_metrics.py", U + "test_values_algo.py"), "ess without the square of the mean weight"),
    Bug("c03", "third", "megatron_rl/loop/refill.py",
        "take[rank] = min(int(available), remaining)", "take[rank] = min(int(available), target)",
        (U + "test_refill_plan.py", U + "test_values_loop.py"), "refill lets each rank take up to the target"),
    Bug("c04", "third", "megatron_rl/rewards/runner.py",
        "rest = [] if self.batched else list(worker.items)[1:]", "rest = [] if self.batched else list(worker.items)",
        (U + "test_rewards_pool.py", U + "test_rewards_runner.py", U + "test_values_rewards_data.py"),
        "a timed-out item is queued again with the rest of its chunk"),
    Bug("c05", "third", "megatron_rl/loop/run_folder.py",
        'or (log_dir / "checkpoints").is_dir()', 'or (log_dir / "checkpoints" / "latest").is_file()',
        (U + "test_run_folder.py", U + "test_values_loop.py"), "a folder with checkpoints but no latest is not a run"),
    Bug("c06", "third", "megatron_rl/data/loader.py",
        '        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])\n', "",
        (U + "test_data_loader.py", U + "test_values_rewards_data.py"), "a resumed loader keeps its own seed, not the checkpoint's"),
    Bug("c07", "third", "megatron_rl/telemetry/health.py",
        "self.first_surge = self.onset", "self.first_surge = step",
        (U + "test_health.py", U + "test_values_telemetry.py"), "surge_step is the detection step, not the onset"),
    Bug("c08", "third", "megatron_rl/algo/eval_metrics.py",
        "if match is None or int(match.group(2)) < 1:", "if match is None or int(match.group(2)) < 0:",
        (U + "test_eval_metrics.py", U + "test_values_algo.py"), "avg@0 / pass@0 accepted"),
    Bug("c09", "third", "megatron_rl/loop/evaluate.py",
        'if metric and metric != "time" and f"{head}/{metric}" in out:', 'if metric and f"{head}/{metric}" in out:',
        (U + "test_eval_sampling.py", U + "test_values_loop.py"), "rollout_minus_bf16 of the eval time logged"),
    Bug("c10", "third", "megatron_rl/algo/rollout_correction.py",
        "log_w = log_w / valid.sum(dim=-1, keepdim=True).clamp(min=1)", "log_w = log_w / valid.shape[-1]",
        (U + "test_algo_loss_modes.py", U + "test_values_algo.py"), "geo_mean weight over the padded length, not the valid tokens"),
]
BUGS += THIRD


def _git_clean(path: str) -> bool:
    return subprocess.run(["git", "diff", "--quiet", "--", path], cwd=ROOT).returncode == 0


def run_bug(bug: Bug, timeout: int, old_tests_only: bool = False) -> dict:
    path = ROOT / bug.file
    original = path.read_text()
    if original.count(bug.old) != 1:
        return {"id": bug.id, "status": "stale", "what": bug.what}
    try:  # a bug must still import: a syntax error would be "caught" by any test
        compile(original.replace(bug.old, bug.new), bug.file, "exec")
    except SyntaxError as err:
        return {"id": bug.id, "status": "broken", "what": f"{bug.what}: {err}"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    try:
        path.write_text(original.replace(bug.old, bug.new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               f"--timeout={timeout}", *(() if old_tests_only else bug.new_tests),
                               *bug.tests], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout * 3)
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        status = "caught" if proc.returncode != 0 else "missed"
    except subprocess.TimeoutExpired:
        status, failed = "caught", ["timeout"]
    finally:
        path.write_text(original)
    if not _git_clean(bug.file):
        raise SystemExit(f"{bug.file} not restored: check `git diff`")
    return {"id": bug.id, "round": bug.round, "file": bug.file, "what": bug.what, "status": status,
            "by": failed[:3], "seconds": round(time.time() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*")
    p.add_argument("--round", choices=("before", "after", "third"))
    p.add_argument("--list", action="store_true")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--out", default="realistic_bugs.json")
    p.add_argument("--old-tests-only", action="store_true", help="run only the test files that predate issue 42")
    a = p.parse_args()
    bugs = [b for b in BUGS if (not a.only or b.id in a.only) and (not a.round or b.round == a.round)]
    if a.list:
        for b in bugs:
            print(f"{b.id} {b.round:6} {b.file}: {b.what}")
        return
    results = []
    for bug in bugs:
        results.append(run_bug(bug, a.timeout, a.old_tests_only))
        print(json.dumps(results[-1]), flush=True)
    caught = sum(r["status"] == "caught" for r in results)
    summary = {"caught": caught, "total": len(results), "rate": caught / max(len(results), 1), "bugs": results}
    Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"caught {caught} of {len(results)}")


if __name__ == "__main__":
    main()
