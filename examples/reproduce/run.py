"""The precision study: BF16 vs vanilla FP8 (four scaling granularities) vs FP8 + Calibrated Clipping.

One command runs every variant on the tiny task with the same model, data and seeds, then writes
the report (table, claims, figures) with megatron_rl.report:

  python examples/reproduce/run.py                       # all variants, seed 1 -> docs/reproduction/
  python examples/reproduce/run.py --seeds 1 2 --jobs 2  # more seeds, two runs at a time
  python examples/reproduce/run.py --variants bf16 fp8_tensorwise --steps 3 --out /tmp/r  # a quick look
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Full-pipeline FP8: every FP8 variant also rolls out with the W8A8 blockwise engine.
FP8 = ["precision.rollout_quant=fp8_blockwise", "calib.diagnose=true"]
VARIANTS = {
    "bf16": ["precision.train_recipe=bf16", "precision.rollout_quant=bf16"],
    "fp8_tensorwise": ["precision.train_recipe=tensorwise", "precision.fp8_format=hybrid", *FP8],
    "fp8_rowwise": ["precision.train_recipe=rowwise", "precision.fp8_format=hybrid", *FP8],
    "fp8_blockwise": ["precision.train_recipe=blockwise", "precision.fp8_format=e4m3", *FP8],
    "fp8_mxfp8": ["precision.train_recipe=mxfp8", "precision.fp8_format=e4m3", *FP8],
    "fp8_tensorwise_calibrated": ["precision.train_recipe=tensorwise", "precision.fp8_format=hybrid",
                                  *FP8, "calib.enabled=true"],
    "fp8_tensorwise_lower_only": ["precision.train_recipe=tensorwise", "precision.fp8_format=hybrid",
                                  *FP8, "calib.enabled=true", "calib.mode=lower_only"],
}


def run_one(name: str, seed: int, root: Path, extra: list[str]) -> Path:
    log_dir = root / f"{name}_seed{seed}"
    if (log_dir / "done").exists():
        return log_dir
    cmd = [sys.executable, "-m", "megatron_rl.train", str(HERE / "base.yaml"), *VARIANTS[name],
           f"train.seed={seed}", f"log.dir={log_dir}", f"calib.dump_dir={log_dir / 'calib'}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "stdout.log", "w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"variant {name} seed {seed} failed: see {log_dir / 'stdout.log'}")
    (log_dir / "done").write_text("ok\n")
    return log_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[1])
    parser.add_argument("--steps", type=int, default=None, help="override train.num_steps")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one core each)")
    parser.add_argument("--runs-dir", default="runs/reproduce")
    parser.add_argument("--out", default="docs/reproduction")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value for every run")
    args = parser.parse_args(argv)
    extra = list(args.overrides) + ([f"train.num_steps={args.steps}"] if args.steps else [])
    jobs = [(v, s) for s in args.seeds for v in args.variants]
    with ThreadPoolExecutor(args.jobs) as pool:  # a failed run does not cancel the others
        futures = [pool.submit(run_one, v, s, Path(args.runs_dir), extra) for v, s in jobs]
    done, failed = [], []
    for (v, s), fut in zip(jobs, futures):
        (failed if fut.exception() else done).append((v, s, fut))
    for v, s, fut in failed:
        print(f"FAILED: {fut.exception()}", file=sys.stderr)
    if not done:
        return 1
    from megatron_rl.report import load_runs, write_report

    runs = load_runs([f.result() for _, _, f in done], [f"{v} s{s}" for v, s, _ in done])
    print(write_report(runs, args.out, "Precision study: BF16 vs FP8 vs FP8 + Calibrated Clipping"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
