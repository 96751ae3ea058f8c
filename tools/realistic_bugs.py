"""Hand-written realistic bugs (not mutation operators): each is applied alone, its mapped test files
run, and the source restored (always: try/finally, then `git diff` checked clean).

    python tools/realistic_bugs.py                 # every bug -> realistic_bugs.json
    python tools/realistic_bugs.py --only b03 b07  # some
    python tools/realistic_bugs.py --list
    python tools/realistic_bugs.py --round fourth --with-value-tests --out fourth.json

A bug is caught when any of its mapped test files fails. Only those files run (a targeted subset), so
a bug that only some other test would catch counts as missed. `round` says when the bug was
written: before the tests of issue 42 ("before"), after the first of them ("after"), after all of
them ("third"), or from the product code alone while a further set of value tests was being written,
without looking at them ("fourth": an independent measure), or from the product code alone after
that wave's tests had landed ("fifth": the same kind of measure, later).

--with-value-tests (rounds "fourth" and "fifth" only): a bug also runs every value-test file present at run time,
tests/unit/test_values_*.py and tests/dist/test_values_*.py, whose name shares a word with the bug's
module. A module's words: its path under megatron_rl/ split at "/" and "_", without ".py"
(megatron_rl/algo/calibrated_clip.py -> algo, calibrated, clip; megatron_rl/train.py -> train). A test
file's words: its name after "test_values_", split at "_", without ".py" and a trailing "dist"
(test_values_checkpoint_dist.py -> checkpoint). A value-test file that imports the bug's module (its
dotted path, or `from <package> import <name>`), itself or through a harness of tests/doubles it
imports, runs too. Value tests added later are picked up
without editing the bug list; a bug whose module shares no word with any of them runs its mapped tests alone.
With the flag, the value-test files are first run on the unmodified tree: a failure there stops the
tool (a bug would be "caught" by a test that fails anyway).

Every pytest run gets a fresh, empty Hypothesis database and --hypothesis-seed=0: property tests
draw the same examples for every bug, and a failing example that one run saved cannot fail the runs
of the bugs after it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
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

FOURTH: list[Bug] = [  # a fourth round, written from the product code alone (an independent measure)
    # ---- algo/calibrated_clip.py
    Bug("d01", "fourth", "megatron_rl/algo/calibrated_clip.py",
        "self.next_due = (self.next_due if step is None else step) // self.period * self.period + self.period",
        "self.next_due = (self.next_due if step is None else step) + self.period",
        (U + "test_algo_calibrated_clip.py", U + "test_algo_calibrated_clip_sequence.py"),
        "after a retried calibration the next one is due period steps after the retry, off the grid"),
    Bug("d02", "fourth", "megatron_rl/algo/calibrated_clip.py",
        "high_raw, high_status = solve_high(hist, math.log(low), self.rules)",
        "high_raw, high_status = solve_high(hist, math.log(low if low_raw is None else low_raw), self.rules)",
        (U + "test_algo_calibrated_clip.py", U + "test_algo_calibrated_clip_sequence.py"),
        "smoothing < 1: H solved at the raw L*, not at the smoothed L that is applied"),
    Bug("d03", "fourth", "megatron_rl/algo/calibrated_clip.py",
        'self.high = 1.0 + eps_high if init_high is None or mode == "lower_only" else float(init_high)',
        "self.high = 1.0 + eps_high if init_high is None else float(init_high)",
        (U + "test_algo_calibrated_clip.py", U + "test_algo_calibrated_clip_sequence.py"),
        "mode lower_only starts H at init_high instead of holding 1 + eps_high"),
    # ---- algo/policy_loss.py
    Bug("d04", "fourth", "megatron_rl/algo/policy_loss.py",
        "return (valid.sum(dim=-1) > 0).sum()", "return torch.tensor(valid.shape[0])",
        (U + "test_algo_policy_loss.py", U + "test_algo_loss_modes.py"),
        "seq-mean denominators count fully masked rows"),
    Bug("d05", "fourth", "megatron_rl/algo/policy_loss.py",
        "metrics.update(mismatch_metrics(old_logprobs, rollout_logprobs, response))",
        "metrics.update(mismatch_metrics(old_logprobs, rollout_logprobs, valid))",
        (U + "test_algo_policy_loss.py", U + "test_algo_loss_modes.py"),
        "mismatch metrics over the kept tokens: rejection hides the mismatch it rejected"),
    Bug("d06", "fourth", "megatron_rl/algo/policy_loss.py",
        "penalty_tok, penalty_metrics = _penalties(\n        logprobs, valid, ref_logprobs,",
        "penalty_tok, penalty_metrics = _penalties(\n"
        "        torch.where(valid, old_logprobs.detach().float(), 0.0), valid, ref_logprobs,",
        (U + "test_algo_policy_loss.py", U + "test_algo_loss_modes.py"),
        "KL penalty evaluated at old_logprobs: same value on-policy, no gradient"),
    Bug("d07", "fourth", "megatron_rl/algo/policy_loss.py",
        "weights = weights / valid.sum(dim=-1, keepdim=True).clamp(min=1)",
        "weights = weights / response.sum(dim=-1, keepdim=True).clamp(min=1)",
        (U + "test_algo_policy_loss.py", U + "test_algo_loss_modes.py", U + "test_algo_calibrated_clip.py"),
        "seq-mean-token-mean token weights divide by the response length before rejection"),
    # ---- algo/ratio_histogram.py
    Bug("d08", "fourth", "megatron_rl/algo/ratio_histogram.py",
        "self._add_ref_side(rr, adv, w * ~((adv < 0) & (rr > c)))",
        "self._add_ref_side(rr, adv, w * ~((adv < 0) & (r8 > c)))",
        (U + "test_algo_calibrated_clip.py", U + "test_algo_calibrated_clip_sequence.py"),
        "the BF16 side's dual-clip exclusion tests the FP8 ratio"),
    Bug("d09", "fourth", "megatron_rl/algo/ratio_histogram.py",
        "neg_kept, pos_kept = neg & (rr >= 1.0 - self.eps_low), pos & (rr <= 1.0 + self.eps_high)",
        "neg_kept, pos_kept = neg & (rr > 1.0 - self.eps_low), pos & (rr < 1.0 + self.eps_high)",
        (U + "test_algo_calibrated_clip.py", U + "test_algo_calibrated_clip_sequence.py"),
        "a BF16 ratio exactly at 1 - eps / 1 + eps counted as clipped"),
    Bug("d10", "fourth", "megatron_rl/algo/ratio_histogram.py",
        "w = torch.where(valid, weights.detach().double(), 0.0).sum(dim=-1, keepdim=True)",
        "w = torch.where(valid, weights.detach().double(), 0.0).sum(dim=-1, keepdim=True)"
        " / valid.sum(dim=-1, keepdim=True).clamp(min=1)",
        (U + "test_algo_calibrated_clip_sequence.py", U + "test_algo_calibrated_clip.py"),
        "a sequence's histogram weight is the mean of its token weights, not their sum"),
    # ---- telemetry/
    Bug("d11", "fourth", "megatron_rl/telemetry/report.py",
        "vals = vals[-max(1, len(vals) // 4):]", "vals = vals[-(len(vals) // 4):]",
        (U + "test_report.py",), "'last quarter' of fewer than 4 values averages all of them"),
    Bug("d12", "fourth", "megatron_rl/telemetry/report.py",
        'return label.rsplit(" s", 1)[0] if " s" in label else label', 'return label.split(" s")[0]',
        (U + "test_report.py",), "claims table: a variant label is cut at its first ' s' (variants merged)"),
    Bug("d13", "fourth", "megatron_rl/telemetry/logger.py",
        'if line.strip() and json.loads(line)["step"] < start_step]',
        'if line.strip() and json.loads(line)["step"] <= start_step]',
        (U + "test_telemetry.py",), "a resumed log keeps the resume step's old line: that step is logged twice"),
    Bug("d14", "fourth", "megatron_rl/telemetry/health.py",
        "if entropy is not None and step >= self.warmup_steps:", "if entropy is not None and step > self.warmup_steps:",
        (U + "test_health.py",), "surge detector skips one step past warmup_steps"),
    # ---- loop/phases.py
    Bug("d15", "fourth", "megatron_rl/loop/phases.py",
        "_loss_fn(run, denominator, _bounds(run), calibrating, forced)",
        "_loss_fn(run, denominator, run.controller.bounds, calibrating, forced)",
        (U + "test_phases_calib.py", U + "test_phases_losses.py", U + "test_phases_run.py"),
        "the loss clips at the controller's bounds with calibration off (diagnose, CISPO); the log shows the configured ones"),
    Bug("d16", "fourth", "megatron_rl/loop/phases.py",
        'kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], a.kl_loss_type) * mask',
        'kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], a.kl_reward_type) * mask',
        (U + "test_phases_run.py", "tests/e2e/test_reference.py"), "kl/ref_mean uses the reward's KL estimator"),
    Bug("d17", "fourth", "megatron_rl/loop/phases.py",
        "forced = cfg.algo.force_on_policy_ratio and epoch == 0 and i == 0",
        "forced = cfg.algo.force_on_policy_ratio and i == 0",
        (U + "test_phases_losses.py", U + "test_phases_run.py", U + "test_algo_force_on_policy.py"),
        "force_on_policy_ratio forces the first mini-batch of every PPO epoch"),
    Bug("d18", "fourth", "megatron_rl/loop/phases.py",
        "float((penalty * kept).sum()), float(kept.sum())]", "float((penalty * kept).sum()), float(kept.numel())]",
        (U + "test_phases_run.py", "tests/e2e/test_reference.py"),
        "kl/reward_penalty averaged over the filler rows of dynamic sampling too"),
    # ---- loop/build.py
    Bug("d19", "fourth", "megatron_rl/loop/build.py",
        "return bool(every) and (step + 1) % every == 0", "return bool(every) and step % every == 0",
        (U + "test_build_run.py",), "save_hf_every exports one step early (and after step 0)"),
    Bug("d20", "fourth", "megatron_rl/loop/build.py",
        "batched = r.batched and name == r.name", "batched = r.batched",
        (U + "test_build_run.py",), "an eval dataset's own reward is called batched because the training one is"),
    Bug("d21", "fourth", "megatron_rl/loop/build.py",
        "return sg.startup_timeout_s + (sg.max_retries + 1) * sg.request_timeout_s + 600.0",
        "return sg.startup_timeout_s + sg.max_retries * sg.request_timeout_s + 600.0",
        (U + "test_host_wait.py", U + "test_build_run.py"), "long-wait timeout counts retries, not attempts"),
    # ---- checkpointing: loop/checkpoint.py, loop/best.py
    Bug("d22", "fourth", "megatron_rl/loop/checkpoint.py",
        'keep = set(steps[-self.keep_last:]) | {', 'keep = set(steps[len(steps) - self.keep_last:]) | {',
        (U + "test_checkpoint_retention.py", U + "test_checkpoint_faults.py"),
        "fewer checkpoints than keep_last: all but the newest deleted"),
    Bug("d23", "fourth", "megatron_rl/loop/checkpoint.py",
        '{self._marked_step("latest"), self._marked_step("best")}', '{self._marked_step("latest")}',
        (U + "test_checkpoint_retention.py", U + "test_checkpoint_faults.py"), "retention deletes the best checkpoint"),
    Bug("d24", "fourth", "megatron_rl/loop/checkpoint.py",
        'state["rng"] = rngs[parallel.rank] if parallel.rank < len(rngs) else rngs[0]',
        'state["rng"] = rngs[parallel.rank % len(rngs)]',
        (U + "test_checkpoint_faults.py", U + "test_checkpoint_retention.py"),
        "resumed on more ranks: a new rank takes rank (r mod saved)'s RNG, not rank 0's"),
    Bug("d25", "fourth", "megatron_rl/loop/checkpoint.py",
        'run.sync.version = state["sync_version"] - 1', 'run.sync.version = state["sync_version"]',
        (U + "test_checkpoint_faults.py", U + "test_checkpoint_retention.py"),
        "a resumed run's weight version one ahead of the uninterrupted run's"),
    Bug("d26", "fourth", "megatron_rl/loop/best.py",
        'if state.get("metric") != self.metric:', 'if "metric" not in state:',
        (U + "test_eval_bookkeeping.py",), "best.json of another eval metric continues the record"),
    # ---- the colocated path: loop/colocated.py and its use in train.py
    Bug("d27", "fourth", "megatron_rl/loop/colocated.py",
        'RESUME_AFTER_SYNC = ("kv_cache", "cuda_graph")', 'RESUME_AFTER_SYNC = ("kv_cache",)',
        (U + "test_colocated_memory.py", U + "test_sglang_release_tags.py"),
        "CUDA graphs left released after the sync"),
    Bug("d28", "fourth", "megatron_rl/loop/colocated.py",
        "self.actor.offload()", 'self.actor.offload(("grads", "optimizer"))',
        (U + "test_colocated_memory.py", U + "test_sglang_release_tags.py"),
        "after a save between steps the trainer's parameters stay on the device"),
    # the decision moved from train.py into loop/colocated.py (protocol_enabled) after this round: the same bug there
    Bug("d29", "fourth", "megatron_rl/loop/colocated.py",
        "return bool(cfg.train.colocated_protocol) and is_colocated(cfg)", "return is_colocated(cfg)",
        ("tests/e2e/test_colocated.py", U + "test_phases_run.py"), "train.colocated_protocol=false ignored"),
    Bug("d30", "fourth", "megatron_rl/train.py",
        "if batch is not None or (rollout.batch is not None and memory.enabled):", "if batch is not None:",
        ("tests/e2e/test_colocated.py", U + "test_phases_run.py"),
        "colocated: a step whose update is skipped does not give the released engine its weights back"),
    # ---- train.py: evaluation / save pairing, logged values, collective state
    Bug("d31", "fourth", "megatron_rl/train.py",
        "metrics.update(_evaluate(run_, evaluator, best, step, step + 1, memory))",
        "metrics.update(_evaluate(run_, evaluator, best, step, step, memory))",
        (U + "test_eval_bookkeeping.py", "tests/e2e/test_eval.py"),
        "the at_end score is paired with the checkpoint before the last update"),
    Bug("d32", "fourth", "megatron_rl/train.py",
        '    metrics["lr"] = run_.actor.lr  # what this step\'s updates use\n'
        "    if rollout.batch is not None:\n"
        "        metrics.update(memory.begin_training())  # colocated: engine out, trainer in\n"
        "    batch = phases.prepare(run_, rollout.batch, step, metrics, memory)  # None: the step is skipped\n"
        "    if batch is not None:\n"
        "        metrics.update(phases.update_policy(run_, batch, step))\n"
        "        run_.actor.advance_lr_schedule()  # per trained step: a skipped step leaves the schedule\n",
        "    if rollout.batch is not None:\n"
        "        metrics.update(memory.begin_training())  # colocated: engine out, trainer in\n"
        "    batch = phases.prepare(run_, rollout.batch, step, metrics, memory)  # None: the step is skipped\n"
        "    if batch is not None:\n"
        "        metrics.update(phases.update_policy(run_, batch, step))\n"
        "        run_.actor.advance_lr_schedule()  # per trained step: a skipped step leaves the schedule\n"
        '    metrics["lr"] = run_.actor.lr\n',
        ("tests/e2e/test_rl_loop.py", U + "test_actor_schedule.py"),
        "lr logged after the schedule advanced: the next step's lr, not the one the updates used"),
    Bug("d33", "fourth", "megatron_rl/train.py",
        "return collectives.broadcast_object(detector, 0, None)",
        "return detector or SurgeDetector.from_config(run_.cfg.health)",
        (U + "test_health.py", "tests/dist/test_phases_dp.py"),
        "health detector rebuilt from the log on rank 0 only: other ranks restart it empty on resume"),
    # ---- rewards/http.py
    Bug("d34", "fourth", "megatron_rl/rewards/http.py",
        "RETRIED_STATUS = (429, 500, 502, 503, 504)", "RETRIED_STATUS = (500, 502, 503, 504)",
        (U + "test_rewards_http.py",), "HTTP 429 (rate limited) not retried"),
    Bug("d35", "fourth", "megatron_rl/rewards/http.py",
        "time.sleep(self.backoff_s * 2 ** (attempt - 1))", "time.sleep(self.backoff_s * 2 ** attempt)",
        (U + "test_rewards_http.py",), "backoff doubled from the first retry: every sleep twice the budget's"),
    Bug("d36", "fourth", "megatron_rl/rewards/http.py",
        "return (self.max_retries + 1) * self.timeout_s + backoff", "return self.max_retries * self.timeout_s + backoff",
        (U + "test_rewards_http.py", U + "test_build_run.py"),
        "the call's budget counts retries, not attempts: the runner kills the last attempt"),
    # ---- data: word_math, prompt_file, templates (datasets), tasks
    Bug("d37", "fourth", "megatron_rl/data/word_math.py",
        "paid = next(bill for bill in BILLS if bill >= price * count)",
        "paid = next(bill for bill in BILLS if bill > price * count)",
        (U + "test_data_word_math.py",), "an exact bill is not the smallest that pays (and 5000 exact has none)"),
    Bug("d38", "fourth", "megatron_rl/data/word_math.py",
        "friend = rng.choice([x for x in NAMES if x != name])", "friend = rng.choice(NAMES)",
        (U + "test_data_word_math.py",), "take-away: a name gives items to itself"),
    Bug("d39", "fourth", "megatron_rl/data/prompt_file.py",
        "            except json.JSONDecodeError:\n                continue",
        "            except json.JSONDecodeError:\n                break",
        (U + "test_preflight.py",), "a bad JSON line before the first row: the file is refused as empty"),
    Bug("d40", "fourth", "megatron_rl/data/prompt_file.py",
        "return lookup(first, column) is not None", "return column in first",
        (U + "test_preflight.py",), "JSONL check: dotted columns not followed (and a null column passes)"),
    Bug("d41", "fourth", "megatron_rl/data/datasets.py",
        "            text = self._templated(prompt)\n", "            text = prompt\n",
        (U + "test_data_datasets.py", U + "test_data_knobs.py"), "prompt_template ignored without a chat template"),
    Bug("d42", "fourth", "megatron_rl/data/datasets.py",
        "add_generation_prompt=True, tokenize=False, **self.fmt.template_kwargs",
        "add_generation_prompt=True, tokenize=False",
        (U + "test_data_datasets.py", U + "test_data_knobs.py"), "data.template_kwargs not passed to the chat template"),
    Bug("d43", "fourth", "megatron_rl/data/tasks.py",
        r'_CHAIN_RE = re.compile(r"\d+\+\d+=\d+(,\d+\+\d+=\d+)*:\d+", re.ASCII)',
        r'_CHAIN_RE = re.compile(r"\d+\+\d+=\d+(,\d+\+\d+=\d+)+:\d+", re.ASCII)',
        (U + "test_data_tasks.py", U + "test_data_datasets.py"), "a one-step chain (num_terms=2) counted as garbled"),
    Bug("d44", "fourth", "megatron_rl/data/tasks.py",
        'if merged.get("min_len", 0) > merged.get("max_len", 1 << 30):',
        'if merged.get("min_len", 0) >= merged.get("max_len", 1 << 30):',
        (U + "test_data_tasks.py", U + "test_data_datasets.py"), "min_len == max_len refused"),
    # ---- cluster/memory.py
    Bug("d45", "fourth", "megatron_rl/cluster/memory.py",
        "if s.use_distributed_optimizer:\n        optimizer /= dp", "if dp > 1:\n        optimizer /= dp",
        (U + "test_memory_parts.py", U + "test_plan.py"), "optimizer state sharded over DP without the distributed optimizer"),
    Bug("d46", "fourth", "megatron_rl/cluster/memory.py",
        "chunk = min(par.recompute_num_layers, layers)", "chunk = par.recompute_num_layers",
        (U + "test_memory_parts.py", U + "test_plan.py"), "full recompute chunk not capped at the stage's layers"),
    Bug("d47", "fourth", "megatron_rl/cluster/memory.py",
        "return max(spec.num_query_groups // tp, 1) * 2", "return spec.num_query_groups / tp * 2",
        (U + "test_memory_parts.py", U + "test_plan.py"), "KV cell with fewer KV heads than TP: heads split, not replicated"),
    Bug("d48", "fourth", "megatron_rl/cluster/memory.py",
        "return -(-t.max_tokens_per_micro_batch // multiple) * multiple",
        "return t.max_tokens_per_micro_batch // multiple * multiple",
        (U + "test_memory_parts.py", U + "test_plan.py"), "packed micro-batch tokens rounded down to the pad multiple"),
]
BUGS += FOURTH

FIFTH: list[Bug] = [  # a fifth round, written from the product code alone after the wave's tests landed
    # ---- loop/
    Bug("e01", "fifth", "megatron_rl/loop/refill.py",
        "    if kept >= target:\n        return False", "    if kept > target:\n        return False",
        (U + "test_refill_plan.py",), "refill samples one more round when exactly the target groups were kept"),
    Bug("e02", "fifth", "megatron_rl/loop/sampling.py",
        "knobs.update({k: v for k, v in (overrides or {}).items() if v is not None})",
        "knobs.update({k: v for k, v in (overrides or {}).items() if v})",
        (U + "test_eval_sampling.py",), "an eval set's temperature 0 (greedy) override dropped for the rollout's"),
    Bug("e03", "fifth", "megatron_rl/loop/phases.py",
        "counts[run.parallel.dp_rank] = float(keep.sum()) / n", "counts[run.parallel.dp_rank] = float(keep.sum())",
        (U + "test_phases_run.py", U + "test_refill_plan.py", "tests/e2e/test_refill.py"),
        "dynamic sampling counts kept rows as kept groups: refill stops with 1/n of the target"),
    Bug("e04", "fifth", "megatron_rl/loop/phases.py",
        "one = cfg.train.ppo_epochs * cfg.train.num_mini_batches == 1", "one = cfg.train.num_mini_batches == 1",
        (U + "test_phases_losses.py", U + "test_phases_run.py", U + "test_algo_force_on_policy.py"),
        "force_on_policy_ratio skips the old-log-prob forward with one mini-batch but several PPO epochs"),
    Bug("e05", "fifth", "megatron_rl/loop/evaluate.py",
        "        if name not in self.runners:\n"
        "            self.runners[name] = build.build_rewards(self.run.cfg, name)\n"
        "        return self.runners[name]",
        "        if not self.runners:\n"
        "            self.runners[name] = build.build_rewards(self.run.cfg, name)\n"
        "        return next(iter(self.runners.values()))",
        (U + "test_eval_sampling.py", "tests/e2e/test_eval.py"),
        "one reward runner cached for every eval set: the first set's reward scores the others"),
    Bug("e06", "fifth", "megatron_rl/loop/evaluate.py",
        '"max_new_tokens": d.max_new_tokens or None,', '"max_new_tokens": d.max_new_tokens,',
        (U + "test_eval_sampling.py", U + "test_config_eval.py"),
        "an eval set without max_new_tokens (0) asks for 0 new tokens instead of the rollout's"),
    Bug("e07", "fifth", "megatron_rl/loop/best.py",
        "if step < 1 or self._pending is None", "if step < 0 or self._pending is None",
        (U + "test_eval_bookkeeping.py",), "the at_start score becomes best at step 0, which has no checkpoint"),
    Bug("e08", "fifth", "megatron_rl/loop/checkpoint.py",
        "            shutil.rmtree(final, ignore_errors=True)\n            os.replace(tmp, final)",
        "            os.replace(tmp, final)",
        (U + "test_checkpoint_faults.py", U + "test_checkpoint_retention.py"),
        "a step folder left by a kill before `latest` moved makes the re-save of that step fail"),
    Bug("e09", "fifth", "megatron_rl/loop/run_folder.py",
        '    if c.overwrite:\n        return "overwrite"\n'
        '    hint = "pass --overwrite (checkpoint.overwrite=true) to delete it, or choose another log.dir"\n'
        "    if c.resume is False:\n"
        "        raise ValueError(f\"config key 'checkpoint.resume': false, but log.dir {log_dir} holds a run; {hint}\")\n",
        '    hint = "pass --overwrite (checkpoint.overwrite=true) to delete it, or choose another log.dir"\n'
        "    if c.resume is False:\n"
        "        raise ValueError(f\"config key 'checkpoint.resume': false, but log.dir {log_dir} holds a run; {hint}\")\n"
        '    if c.overwrite:\n        return "overwrite"\n',
        (U + "test_run_folder.py",), "checkpoint.resume=false with --overwrite refuses the folder instead of overwriting"),
    Bug("e10", "fifth", "megatron_rl/loop/preflight.py",
        '        if e.reward:\n            _check(get_reward_fn, e.reward, f"{key}.reward")\n', "",
        (U + "test_preflight.py",), "a misspelt eval dataset reward passes preflight (fails after the actor is built)"),
    Bug("e11", "fifth", "megatron_rl/loop/signals.py",
        "        if byte == bytes([signal.SIGTERM]):  # another handled signal (SIGINT, SIGUSR1): not ours\n",
        "        if byte != bytes([signal.SIGINT]):  # SIGINT is KeyboardInterrupt's\n",
        (U + "test_signals.py", "tests/e2e/test_stop_signal.py"),
        "the SIGTERM watcher exits 143 on a SIGUSR1 stop request too"),
    Bug("e27", "fifth", "megatron_rl/loop/evaluate.py",
        'if not name.startswith("maj@") or total[-1] > 0}', 'if not name.startswith("maj@") or has_preds}',
        (U + "test_eval_sampling.py",),
        "maj@k kept or dropped by each rank's own shard, not by the reduced count of ranks with predictions"),
    # ---- algo/
    Bug("e12", "fifth", "megatron_rl/algo/advantages.py",
        "sums = torch.stack([n.sum(), (n * centred).sum(), (n * centred.square()).sum()])",
        "sums = torch.stack([n.sum(), centred.sum(), (n * centred.square()).sum()])",
        (U + "test_algo_advantages.py",), "REINFORCE++ whitening mean over samples, not token-weighted"),
    Bug("e13", "fifth", "megatron_rl/algo/eval_metrics.py",
        "            out[name] = avg_at_k(rewards)", "            out[name] = avg_at_k(rewards[:k])",
        (U + "test_eval_metrics.py",), "avg@k averages the first k samples, not all n"),
    Bug("e14", "fifth", "megatron_rl/algo/loss_spec.py",
        "if s.eps_clip_c is not None and not s.eps_clip_c > 1.0:", "if s.eps_clip_c is not None and s.eps_clip_c < 1.0:",
        (U + "test_algo_loss_spec.py",), "LossSpec accepts dual-clip c = 1"),
    Bug("e15", "fifth", "megatron_rl/algo/policy_loss.py",
        '"clip/high_pos": metric((clips.high & valid).sum(), pos.sum()),',
        '"clip/high_pos": metric((clips.high & valid).sum(), valid.sum()),',
        (U + "test_algo_policy_loss.py", U + "test_algo_loss_modes.py"),
        "clip/high_pos over every token, not the A > 0 ones"),
    Bug("e16", "fifth", "megatron_rl/algo/calibrated_clip.py",
        "eps_low, eps_high = (algo.eps_clip, algo.eps_clip_high) if clipped else (0.2, 0.2)",
        "eps_low, eps_high = (algo.eps_clip, algo.eps_clip) if clipped else (0.2, 0.2)",
        (U + "test_algo_calibrated_clip.py", U + "test_algo_calibrated_clip_sequence.py", U + "test_phases_calib.py"),
        "the calibration's BF16 bounds ignore algo.eps_clip_high (clip-higher)"),
    # ---- telemetry/
    Bug("e17", "fifth", "megatron_rl/telemetry/health.py",
        "        if garbled is not None:\n            self.garbled.add",
        "        if garbled is not None and step >= self.warmup_steps:\n            self.garbled.add",
        (U + "test_health.py",), "the garbled-output streak waits for health.warmup_steps"),
    Bug("e18", "fifth", "megatron_rl/telemetry/stats.py",
        "for a in range(low, high + 1) if", "for a in range(low, high) if",
        (U + "test_stats.py",), "Fisher's test leaves out the last table with the margins"),
    # ---- rewards/
    Bug("e19", "fifth", "megatron_rl/rewards/functions.py",
        "return sum(r == a for r, a in zip(response, answer)) / longest",
        "return sum(r == a for r, a in zip(response, answer)) / max(len(answer), 1)",
        (U + "test_rewards_functions.py",), "position_match over the answer's length: a longer response loses nothing"),
    Bug("e20", "fifth", "megatron_rl/rewards/user.py",
        'name = "megatron_rl_user_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]',
        'name = "megatron_rl_user_reward_" + file.stem',
        (U + "test_rewards_user.py",), "two reward files of the same name in two folders share one module"),
    # ---- data/
    Bug("e21", "fifth", "megatron_rl/data/datasets.py",
        'if self.fmt.system_prompt and messages[0]["role"] != "system":', "if self.fmt.system_prompt:",
        (U + "test_data_datasets.py", U + "test_data_knobs.py"),
        "data.system_prompt added before a message list that has its own system message"),
    Bug("e22", "fifth", "megatron_rl/data/datasets.py",
        "if len(ids) > self.max_prompt_len:", "if len(ids) >= self.max_prompt_len:",
        (U + "test_data_datasets.py", U + "test_data_knobs.py"), "a prompt of exactly max_prompt_len tokens skipped"),
    # ---- config/
    Bug("e23", "fifth", "megatron_rl/config/eval.py",
        "        if d.name in names:\n"
        "            raise ValueError(f\"config key 'eval.datasets[{i}].name': {d.name!r} is used twice\")\n", "",
        (U + "test_config_eval.py",), "two eval datasets of one name accepted: one's metrics overwrite the other's"),
    Bug("e24", "fifth", "megatron_rl/config/algo.py",
        "if a.force_on_policy_ratio and (c.enabled or c.diagnose) and t.ppo_epochs",
        "if a.force_on_policy_ratio and c.enabled and t.ppo_epochs",
        (U + "test_config_losses.py", U + "test_config.py"),
        "force_on_policy_ratio x calib.diagnose with one mini-batch accepted (the diagnosis sees ratio 1)"),
    # ---- train.py
    Bug("e25", "fifth", "megatron_rl/train.py",
        '                f.write(f"{step + 1}\\n")', '                f.write(f"{step}\\n")',
        ("tests/e2e/test_stop_request.py", "tests/e2e/test_stop_signal.py"),
        "MEGATRON_RL_STOP_FILE names the stopped step, not the checkpoint's step"),
    Bug("e26", "fifth", "megatron_rl/train.py",
        "    source = next(asdict(d) for d in run_.cfg.eval.datasets if d.name == name)\n"
        "    return BestCheckpoint(run_.checkpointer.root, keep, enabled=run_.is_log_rank, source=source)",
        "    return BestCheckpoint(run_.checkpointer.root, keep, enabled=run_.is_log_rank)",
        (U + "test_eval_bookkeeping.py", "tests/e2e/test_eval.py"),
        "the best record is not tied to the eval set's settings: a resume on other problems continues it"),
]
BUGS += FIFTH


VALUE_TEST_GLOBS = ("tests/unit/test_values_*.py", "tests/dist/test_values_*.py")
VALUE_TEST_ROUNDS = ("fourth", "fifth")  # the rounds --with-value-tests extends


def module_words(path: str) -> set[str]:
    """megatron_rl/algo/calibrated_clip.py -> {"algo", "calibrated", "clip"}."""
    parts = Path(path).with_suffix("").parts
    parts = parts[1:] if parts and parts[0] == "megatron_rl" else parts
    return {w for p in parts for w in p.split("_") if w}


def test_words(path: str) -> set[str]:
    """tests/dist/test_values_checkpoint_dist.py -> {"checkpoint"}."""
    words = Path(path).stem.removeprefix("test_values_").split("_")
    if len(words) > 1 and words[-1] == "dist":
        words = words[:-1]
    return {w for w in words if w}


def imports_module(test_file: str, module_file: str) -> bool:
    """Whether the test file names the module: its dotted path, or `from <package> import ... <name>`."""
    dotted = Path(module_file).with_suffix("").as_posix().replace("/", ".")
    package, _, name = dotted.rpartition(".")
    text = (ROOT / test_file).read_text()
    # and the harnesses it drives the module through (tests/doubles/<name>.py imported by name)
    for helper in re.findall(r"^from (\w+) import", text, flags=re.M):
        double = ROOT / "tests" / "doubles" / f"{helper}.py"
        text += double.read_text() if double.is_file() else ""
    return dotted in text or re.search(rf"from {re.escape(package)} import [^\n]*\b{name}\b", text) is not None


def value_tests_for(bug: Bug) -> tuple[str, ...]:
    """The value-test files present now whose name shares a word with the bug's module, or that import it."""
    files = sorted(str(p.relative_to(ROOT)) for g in VALUE_TEST_GLOBS for p in ROOT.glob(g))
    mine = module_words(bug.file)
    return tuple(f for f in files
                 if (mine & test_words(f) or imports_module(f, bug.file)) and f not in bug.tests)


def _git_clean(path: str) -> bool:
    return subprocess.run(["git", "diff", "--quiet", "--", path], cwd=ROOT).returncode == 0


def _pytest(files: list[str], timeout: int) -> subprocess.CompletedProcess:
    """pytest -x on `files` with a fresh Hypothesis database and a fixed Hypothesis seed."""
    with tempfile.TemporaryDirectory(prefix="realistic_bugs_hypothesis_") as hyp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HYPOTHESIS_STORAGE_DIRECTORY": hyp}
        return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               "--hypothesis-seed=0", f"--timeout={timeout}", *files], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout * 3)


def check_clean(files: list[str], timeout: int) -> None:
    """SystemExit when `files` fail on the unmodified tree."""
    if not files:
        return
    proc = _pytest(files, timeout)
    if proc.returncode != 0:
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        raise SystemExit(f"the value tests fail without any bug, fix them first: {failed or proc.stdout[-2000:]}")


def run_bug(bug: Bug, timeout: int, old_tests_only: bool = False, value_tests: tuple[str, ...] = ()) -> dict:
    path = ROOT / bug.file
    original = path.read_text()
    if original.count(bug.old) != 1:
        return {"id": bug.id, "status": "stale", "what": bug.what}
    try:  # a bug must still import: a syntax error would be "caught" by any test
        compile(original.replace(bug.old, bug.new), bug.file, "exec")
    except SyntaxError as err:
        return {"id": bug.id, "status": "broken", "what": f"{bug.what}: {err}"}
    t0 = time.time()
    try:
        path.write_text(original.replace(bug.old, bug.new))
        proc = _pytest([*value_tests, *(() if old_tests_only else bug.new_tests), *bug.tests], timeout)
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        status = "caught" if proc.returncode != 0 else "missed"
    except subprocess.TimeoutExpired:
        status, failed = "caught", ["timeout"]
    finally:
        path.write_text(original)
    if not _git_clean(bug.file):
        raise SystemExit(f"{bug.file} not restored: check `git diff`")
    return {"id": bug.id, "round": bug.round, "file": bug.file, "what": bug.what, "status": status,
            "by": failed[:3], "seconds": round(time.time() - t0, 1),
            "tests": [*value_tests, *(() if old_tests_only else bug.new_tests), *bug.tests]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*")
    p.add_argument("--round", choices=("before", "after", "third", "fourth", "fifth"))
    p.add_argument("--list", action="store_true")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--out", default="realistic_bugs.json")
    p.add_argument("--old-tests-only", action="store_true", help="run only the test files that predate issue 42")
    p.add_argument("--with-value-tests", action="store_true",
                   help="rounds fourth and fifth: also run the test_values_* files sharing a word with the bug's module")
    a = p.parse_args()
    bugs = [b for b in BUGS if (not a.only or b.id in a.only) and (not a.round or b.round == a.round)]
    if a.list:
        for b in bugs:
            extra = value_tests_for(b) if a.with_value_tests and b.round in VALUE_TEST_ROUNDS else ()
            print(f"{b.id} {b.round:6} {b.file}: {b.what}" + (f" [+ {', '.join(extra)}]" if extra else ""))
        return
    results = []
    t0 = time.time()
    if a.with_value_tests:
        check_clean(sorted({f for b in bugs if b.round in VALUE_TEST_ROUNDS for f in value_tests_for(b)}), a.timeout)
    for bug in bugs:
        extra = value_tests_for(bug) if a.with_value_tests and bug.round in VALUE_TEST_ROUNDS else ()
        results.append(run_bug(bug, a.timeout, a.old_tests_only, extra))
        print(json.dumps(results[-1]), flush=True)
    caught = sum(r["status"] == "caught" for r in results)
    summary = {"caught": caught, "total": len(results), "rate": caught / max(len(results), 1),
               "missed": [r["id"] for r in results if r["status"] != "caught"],
               "seconds": round(time.time() - t0, 1), "bugs": results}
    Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"caught {caught} of {len(results)} in {summary['seconds']} s; missed {summary['missed']}")


if __name__ == "__main__":
    main()
