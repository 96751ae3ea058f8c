"""Cost of the reference model's forward per RL step on the tiny CPU pipeline, as JSON.

Runs examples/tiny/<config> for --steps steps with KL in the loss (the reference forward once per
step, after the old log-probs) and reports the median over steps 1.. (step 0 warms up) of
time/ref_logprobs, time/old_logprobs and time/step, and the reference forward's share of the step
and its ratio to the old log-probs pass (the same pass structure on the same rows) measured in the
same run. Wall-clock seconds on a shared machine: compare the ratios, not the seconds.

examples:
  OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/reference_cost.py
  OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/reference_cost.py --config fp8_calibrated.yaml --precision train
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tiny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="bf16.yaml")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "train"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()

    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.config import load_config
    from megatron_rl.telemetry.logger import read_jsonl
    from megatron_rl.train import run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(EXAMPLES / args.config, [
            f"train.num_steps={args.steps}", f"data.prompts_per_step={args.prompts}", "algo.kl_loss_coef=0.01",
            f"algo.ref_precision={args.precision}", "train.sft_steps=30", "checkpoint.save_every=0",
            "checkpoint.save_final=false", "log.progress=false", "log.tensorboard=false", "log.plot=false",
            f"log.dir={tmp}/run"])
        try:
            run(cfg)
        finally:
            destroy_parallel()
        records = [r for r in read_jsonl(Path(tmp) / "run" / "metrics.jsonl")[1:] if "time/ref_logprobs" in r]
    median = {k: statistics.median(r[k] for r in records) for k in ("time/ref_logprobs", "time/old_logprobs", "time/step")}
    rows = cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt
    print(json.dumps({"config": args.config, "ref_precision": args.precision, "steps_measured": len(records),
                      "rows_per_step": rows, "median_s": median,
                      "ref_share_of_step": median["time/ref_logprobs"] / median["time/step"],
                      "ref_over_old_logprobs": median["time/ref_logprobs"] / median["time/old_logprobs"]}, indent=1))


if __name__ == "__main__":
    main()
