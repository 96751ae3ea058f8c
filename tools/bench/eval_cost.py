"""Benchmark the cost of one held-out evaluation relative to one RL step on the tiny demo, as JSON.

Runs the demo config (examples/tiny/fp8_calibrated.yaml, its eval section: 256 greedy + 256 x 4
sampled sort problems) for a few steps with an evaluation at the top of every step, in this
process, and times each evaluation and each RL step in process CPU time (single-threaded:
robust on a shared machine; the reward worker's few milliseconds are not counted) and in wall
time, in the same run. Reports the medians and their ratio, step 0 (start-up work) excluded.

examples:
  python tools/bench/eval_cost.py
  python tools/bench/eval_cost.py --steps 6 --out runs/bench_eval.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "fp8_calibrated.yaml"


def _timed(fn, into: list):
    """fn, recording (process CPU seconds, wall seconds) of every call into `into`."""

    def wrapper(*args, **kwargs):
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append((time.process_time() - cpu, time.perf_counter() - wall))

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="RL steps, each with an evaluation (default 5)")
    parser.add_argument("--config", default=str(DEMO))
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args()
    from megatron_rl import train
    from megatron_rl.config import load_config
    from megatron_rl.loop.evaluate import Evaluator

    log_dir = Path(tempfile.mkdtemp()) / "run"
    cfg = load_config(args.config, [f"train.num_steps={args.steps}", "eval.every=1", "eval.at_start=true",
                                    "eval.at_end=false", f"log.dir={log_dir}", "log.progress=false",
                                    "log.plot=false", "log.tensorboard=false", "checkpoint.save_every=0",
                                    "checkpoint.save_final=false", "checkpoint.keep_best="])
    times = {"eval": [], "step": []}
    Evaluator.evaluate = _timed(Evaluator.evaluate, times["eval"])
    train._step = _timed(train._step, times["step"])
    train.run(cfg)
    cpu = {k: statistics.median(c for c, _ in v[1:]) for k, v in times.items()}
    wall = {k: statistics.median(w for _, w in v[1:]) for k, v in times.items()}
    out = {"config": Path(args.config).name, "steps_timed": len(times["step"]) - 1,
           "eval_problems": {d.name: d.max_examples for d in cfg.eval.datasets},
           "eval_responses": sum(d.max_examples * d.n_samples for d in cfg.eval.datasets),
           "step_responses": cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt,
           "eval_cpu_s": cpu["eval"], "step_cpu_s": cpu["step"], "eval_over_step_cpu": cpu["eval"] / cpu["step"],
           "eval_wall_s": wall["eval"], "step_wall_s": wall["step"], "eval_over_step_wall": wall["eval"] / wall["step"]}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
