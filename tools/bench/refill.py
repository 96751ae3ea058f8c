"""DAPO dynamic sampling without and with refill on the tiny CPU pipeline, as JSON.

Runs examples/tiny/dapo_fp8_calibrated.yaml for --steps steps twice from the same warm-started
model: algo.max_gen_batches=1 (no refill: the kept part of one batch is trained) and
--max-gen-batches (refill). Reports per run the mean over steps of the share of the batch that
is trained (dapo/kept_fraction: kept groups / data.prompts_per_step), of the informative share of
what was sampled (dynamic_sampling/kept_frac), the generation rounds per step and the step time.

examples:
  OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/refill.py
  OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/refill.py --steps 20 --max-gen-batches 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "dapo_fp8_calibrated.yaml"
KEYS = ("dapo/kept_fraction", "dynamic_sampling/kept_frac", "dapo/gen_batches", "time/step", "reward/accuracy")


def _run(root: Path, name: str, steps: int, max_gen_batches: int) -> dict:
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.config import load_config
    from megatron_rl.telemetry.logger import read_jsonl
    from megatron_rl.train import run

    cfg = load_config(CONFIG, [f"train.num_steps={steps}", f"algo.max_gen_batches={max_gen_batches}",
                               "checkpoint.save_every=0", "checkpoint.save_final=false", "log.progress=false",
                               "log.tensorboard=false", "log.plot=false", f"log.dir={root / name}"])
    try:
        run(cfg)
    finally:
        destroy_parallel()
    records = read_jsonl(root / name / "metrics.jsonl")
    out = {k: statistics.mean(r[k] for r in records) for k in KEYS}
    out["kept_fraction_range"] = [min(r["dapo/kept_fraction"] for r in records),
                                  max(r["dapo/kept_fraction"] for r in records)]
    return {"max_gen_batches": max_gen_batches, "steps": len(records), "mean": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-gen-batches", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:  # both runs share one warm-started tiny model
        before = _run(Path(tmp), "no_refill", args.steps, 1)
        after = _run(Path(tmp), "refill", args.steps, args.max_gen_batches)
    print(json.dumps({"config": CONFIG.name, "no_refill": before, "refill": after,
                      "step_time_ratio": after["mean"]["time/step"] / before["mean"]["time/step"]}, indent=1))


if __name__ == "__main__":
    main()
