"""Benchmark the cost of one held-out evaluation relative to one RL step on the tiny demo, as JSON.

Runs the demo config (examples/tiny/fp8_calibrated.yaml, its eval section: 256 greedy + 256 x 4
sampled sort problems) for a few steps with an evaluation at the top of every step, in this
process, and reads `time/eval` and `time/step` of the same steps from metrics.jsonl: the ratio of
their medians, both measured in the same run (a shared machine slows both alike).

examples:
  python tools/bench/eval_cost.py
  python tools/bench/eval_cost.py --steps 6 --out runs/bench_eval.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "fp8_calibrated.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="RL steps, each with an evaluation (default 5)")
    parser.add_argument("--config", default=str(DEMO))
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args()
    from megatron_rl.config import load_config
    from megatron_rl.telemetry.logger import read_jsonl
    from megatron_rl.train import run

    log_dir = Path(tempfile.mkdtemp()) / "run"
    cfg = load_config(args.config, [f"train.num_steps={args.steps}", "eval.every=1", "eval.at_start=true",
                                    "eval.at_end=false", f"log.dir={log_dir}", "log.progress=false",
                                    "log.plot=false", "log.tensorboard=false", "checkpoint.save_every=0",
                                    "checkpoint.save_final=false", "checkpoint.keep_best="])
    run(cfg)
    records = read_jsonl(log_dir / "metrics.jsonl")[1:]  # step 0 includes one-time start-up work
    evals, steps = [r["time/eval"] for r in records], [r["time/step"] for r in records]
    out = {"config": Path(args.config).name, "steps_timed": len(records),
           "eval_problems": {d.name: d.max_examples for d in cfg.eval.datasets},
           "eval_responses": sum(d.max_examples * d.n_samples for d in cfg.eval.datasets),
           "step_responses": cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt,
           "eval_seconds_median": statistics.median(evals), "step_seconds_median": statistics.median(steps),
           "eval_over_step": statistics.median(evals) / statistics.median(steps)}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
