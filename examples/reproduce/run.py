"""The precision studies: every run of a study with the same model, data and seeds, then one report.

Two studies share this harness (resumable: a finished run is skipped; `--jobs` runs at a time):

- `precision` (base.yaml, the default): BF16 vs vanilla FP8 (four scaling granularities) vs FP8 +
  Calibrated Clipping on the short `sort` task; the report is docs/reproduction/report.md.
- `surge` (surge.yaml): the search for a CPU setting where vanilla full-pipeline low precision
  shows the paper's entropy surge and BF16 does not (docs/reproduction.md, "The entropy-surge
  study"). `--stage screen` runs the declared grid (seed 1, BF16 and vanilla low precision per
  setting); `--stage arms --setting NAME` runs the five arms of one setting (BF16, vanilla, TIS
  only, Calibrated Clipping, lower-only ablation) over `--seeds`.

  python examples/reproduce/run.py                       # precision study, seed 1 -> docs/reproduction/
  python examples/reproduce/run.py --seeds 1 2 --jobs 2  # more seeds, two runs at a time
  python examples/reproduce/run.py --variants bf16 fp8_tensorwise --steps 3 --out /tmp/r  # a quick look
  python examples/reproduce/run.py --study surge --stage screen --jobs 2
  python examples/reproduce/run.py --study surge --stage arms --setting chain_nvfp4 --seeds 1 2 3 --jobs 2
  python examples/reproduce/run.py --study surge --stage heldout --jobs 2   # does CC help beyond TIS?
  python examples/reproduce/run.py --study surge --stage rivals --jobs 2    # CC against its cheap rivals
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

# ---- the entropy-surge study (surge.yaml) --------------------------------------------------------
# Low-precision pipelines of the screen: the training recipe and the rollout engine's numerics.
PIPELINES = {
    "tensorwise": ["precision.train_recipe=tensorwise", "precision.fp8_format=hybrid",
                   "precision.rollout_quant=fp8_tensorwise"],
    "delayed": ["precision.train_recipe=delayed", "precision.fp8_format=hybrid",
                "precision.rollout_quant=fp8_tensorwise"],
    "nvfp4": ["precision.train_recipe=nvfp4", "precision.rollout_quant=nvfp4"],
    "mxfp4": ["precision.train_recipe=mxfp4", "precision.rollout_quant=mxfp4"],
}
BF16 = ["precision.train_recipe=bf16", "precision.rollout_quant=bf16"]
# Planted outlier channels (docs/fp8.md): 32x (LLM.int8()-size outlier features) stresses FP4;
# FP8's exponent absorbs them until about 2^15, so FP8 is stressed at 2^13 (massive-activation size).
OUTLIERS = ["model.outlier_channels=4", "model.outlier_scale=32"]
MASSIVE = ["model.outlier_channels=4", "model.outlier_scale=8192"]
SHORT = ["data.task=sort", "rollout.max_new_tokens=10", "train.sft_steps=50"]  # the precision study's task
# The declared grid: setting -> (pipeline, its BF16 baseline, extra overrides). The screen runs
# every setting vanilla (no TIS, no calibration) and every baseline once.
# On a CPU the parameters are FP32 (precision.params_dtype auto); chain_bf16_params checks that BF16
# parameters and compute (Megatron's mixed precision, FP32 main weights) behave the same.
BASELINES = {"chain_bf16": [], "chain_bf16_params": ["precision.params_dtype=bf16"],
             "chain_bf16_outliers": OUTLIERS, "chain_bf16_massive": MASSIVE, "sort_bf16": SHORT}
SETTINGS = {
    "chain_tensorwise": ("tensorwise", "chain_bf16", []),
    "chain_tensorwise_massive": ("tensorwise", "chain_bf16_massive", MASSIVE),
    "chain_delayed": ("delayed", "chain_bf16", []),
    "chain_nvfp4": ("nvfp4", "chain_bf16", []),
    "chain_nvfp4_outliers": ("nvfp4", "chain_bf16_outliers", OUTLIERS),
    "chain_mxfp4": ("mxfp4", "chain_bf16", []),
    "sort_nvfp4": ("nvfp4", "sort_bf16", SHORT),
}
NO_TIS = ["algo.use_tis=false", "calib.enabled=false"]
ARMS = {  # the arms of one setting (stage "arms") besides its BF16 baseline; "" = vanilla
    "": [*NO_TIS, "calib.diagnose=true"],
    "_tis": ["algo.use_tis=true", "calib.enabled=false", "calib.diagnose=true"],
    "_calibrated": ["algo.use_tis=false", "calib.enabled=true"],
    "_lower_only": ["algo.use_tis=false", "calib.enabled=true", "calib.mode=lower_only"],
    "_calibrated_tis": ["algo.use_tis=true", "calib.enabled=true"],  # the paper's runs: TIS always on
}


# ---- the held-out surge study (stage heldout; docs/reproduction.md, "Does Calibrated Clipping help
# beyond TIS?"): the paper's configuration (TIS on in every arm), 150 steps, held-out accuracy of the
# chain task at the start, every 25 steps and at the end, in the rollout precision and in BF16.
HELDOUT_EVAL = ["train.num_steps=150", "eval.every=25", "eval.precision=both"]
GSPO = ["algo.loss_mode=gspo", "algo.loss_agg_mode=seq-mean-token-mean", "algo.eps_clip=3.0e-4",
        "algo.eps_clip_high=4.0e-4", "algo.use_tis=true", "algo.tis_level=sequence",
        # the histogram (calibration or its diagnosis) on sequence ratios: a bin of 2.9e-5 in log r,
        # a tenth of the GSPO band (config/calib.py checks it)
        "calib.level=sequence", "calib.log_ratio_range=0.03", "calib.low_min=0.99", "calib.high_max=1.01"]
SEQ_CC = ["calib.enabled=true"]
TIS_ON = ["algo.use_tis=true"]
HELDOUT_ARMS = {  # run name -> overrides; the first two are the declared primary comparison
    "heldout_nvfp4_tis": [*PIPELINES["nvfp4"], *TIS_ON, "calib.enabled=false", "calib.diagnose=true"],
    "heldout_nvfp4_calibrated_tis": [*PIPELINES["nvfp4"], *TIS_ON, "calib.enabled=true"],
    "heldout_bf16_tis": [*BF16, *TIS_ON, "calib.enabled=false"],
    "heldout_nvfp4_gspo_tis": [*PIPELINES["nvfp4"], *GSPO, "calib.enabled=false", "calib.diagnose=true"],
    "heldout_nvfp4_gspo_seq_calibrated_tis": [*PIPELINES["nvfp4"], *GSPO, *SEQ_CC],
}
HELDOUT_SEEDS = list(range(1, 9))
HELDOUT_REFERENCE = "heldout_nvfp4_tis"  # differences of held-out accuracy are taken against this arm


# ---- the second held-out study (stage rivals; docs/reproduction.md, "Calibrated Clipping against its
# cheapest rivals"): the held-out study's setting and outcomes, the rivals as arms. Declared before
# any of its runs; the first four arms are the primary block (all seeds first).
DIAGNOSE = ["calib.enabled=false", "calib.diagnose=true"]
RIVAL_ARMS = {
    "rivals_nvfp4_tis": [*PIPELINES["nvfp4"], *TIS_ON, *DIAGNOSE],  # the reference arm
    "rivals_nvfp4_force_tis": [*PIPELINES["nvfp4"], *TIS_ON, *DIAGNOSE, "algo.force_on_policy_ratio=true"],
    "rivals_nvfp4_bf16_old_tis": [*PIPELINES["nvfp4"], *TIS_ON, *DIAGNOSE, "algo.old_logprob_precision=bf16"],
    "rivals_nvfp4_calibrated_tis": [*PIPELINES["nvfp4"], *TIS_ON, "calib.enabled=true"],
    "rivals_nvfp4_icepop": [*PIPELINES["nvfp4"], *TIS_ON, *DIAGNOSE, "algo.tis_mode=icepop"],
    "rivals_nvfp4_dual_clip_tis": [*PIPELINES["nvfp4"], *TIS_ON, *DIAGNOSE, "algo.eps_clip_c=3.0"],
}
RIVAL_PRIMARY = 4
RIVAL_SEEDS = [1, 2, 3, 4]
RIVAL_REFERENCE = "rivals_nvfp4_tis"


def heldout_jobs(runs: dict[str, list[str]], seeds: list[int],
                 primary_arms: list[str] | None = None) -> list[tuple[str, int]]:
    """The declared run order: the primary arms (default: the held-out study's pair, NVFP4 + TIS and
    + CC) over every seed first, then the other arms seed by seed, so a cut budget leaves the primary
    comparison complete."""
    primary_arms = list(HELDOUT_ARMS)[:2] if primary_arms is None else primary_arms
    primary = [n for n in runs if n in primary_arms]
    rest = [n for n in runs if n not in primary]
    return [(n, s) for s in seeds for n in primary] + [(n, s) for s in seeds for n in rest]


def screen_runs() -> dict[str, list[str]]:
    """Run name -> overrides. Names are shared with the arms stage, so seed 1 of a setting's
    vanilla and BF16 runs is reused there (same folder, already done)."""
    runs = {name: [*BF16, *NO_TIS, *extra] for name, extra in BASELINES.items()}
    for name, (pipeline, _, extra) in SETTINGS.items():
        runs[name] = [*PIPELINES[pipeline], *ARMS[""], *extra]
    return runs


def arm_runs(setting: str) -> dict[str, list[str]]:
    if setting not in SETTINGS:
        raise SystemExit(f"unknown --setting {setting!r}; the grid has {sorted(SETTINGS)}")
    pipeline, baseline, extra = SETTINGS[setting]
    return {baseline: [*BF16, *NO_TIS, *BASELINES[baseline]],
            **{setting + arm: [*PIPELINES[pipeline], *overrides, *extra] for arm, overrides in ARMS.items()}}


def run_one(name: str, overrides: list[str], base: Path, seed: int, root: Path, extra: list[str]) -> Path:
    log_dir = root / f"{name}_seed{seed}"
    if (log_dir / "done").exists():
        return log_dir
    cmd = [sys.executable, "-m", "megatron_rl.train", str(base), *overrides,
           f"train.seed={seed}", f"log.dir={log_dir}", f"calib.dump_dir={log_dir / 'calib'}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "stdout.log", "w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"run {name} seed {seed} failed: see {log_dir / 'stdout.log'}")
    (log_dir / "done").write_text("ok\n")
    return log_dir


def _subset(runs: dict[str, list[str]], names: list[str] | None) -> dict[str, list[str]]:
    """The named runs, in the order given (None: all)."""
    unknown = sorted(set(names or ()) - set(runs))
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; this stage has {sorted(runs)}")
    return {name: runs[name] for name in names} if names else runs


def _plan(args) -> tuple[Path, dict[str, list[str]], str, str, str]:
    """(base config, runs, default runs dir, default report dir, title) of the chosen study."""
    if args.study == "precision":
        return (HERE / "base.yaml", {v: VARIANTS[v] for v in args.variants or VARIANTS},
                "runs/reproduce", "docs/reproduction",
                "Precision study: BF16 vs FP8 vs FP8 + Calibrated Clipping")
    if args.stage == "screen":
        return HERE / "surge.yaml", _subset(screen_runs(), args.variants), "runs/surge", "docs/reproduction/surge/screen", \
            "Entropy-surge study: the screen (seed 1, vanilla low precision vs BF16)"
    if args.stage == "heldout":
        return (HERE / "surge.yaml", {n: [*HELDOUT_EVAL, *o] for n, o in _subset(HELDOUT_ARMS, args.variants).items()},
                "runs/surge_heldout", "docs/reproduction/surge/heldout",
                "Held-out surge study: does Calibrated Clipping help beyond TIS?")
    if args.stage == "rivals":
        return (HERE / "surge.yaml", {n: [*HELDOUT_EVAL, *o] for n, o in _subset(RIVAL_ARMS, args.variants).items()},
                "runs/surge_rivals", "docs/reproduction/surge/rivals",
                "Second held-out study: Calibrated Clipping against its cheapest rivals")
    if not args.setting:
        raise SystemExit("--stage arms needs --setting (one of the grid's settings)")
    return (HERE / "surge.yaml", _subset(arm_runs(args.setting), args.variants), "runs/surge",
            f"docs/reproduction/surge/{args.setting}", f"Entropy-surge study: the arms of {args.setting}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", choices=["precision", "surge"], default="precision")
    parser.add_argument("--stage", choices=["screen", "arms", "heldout", "rivals"], default="screen",
                        help="surge study only")
    parser.add_argument("--setting", default="", help="surge study, stage arms: a setting of the grid")
    parser.add_argument("--variants", nargs="*", default=None,
                        help="a subset of the study's runs (precision: variants; surge: run names of the stage)")
    parser.add_argument("--seeds", nargs="*", type=int, default=None,
                        help="default: 1 (the held-out stage: its declared seeds 1-8; rivals: 1-4)")
    parser.add_argument("--steps", type=int, default=None, help="override train.num_steps")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one core each)")
    parser.add_argument("--runs-dir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--write-sweep", default="", metavar="SWEEP.txt",
                        help="write the grid as slurm/sweep.sbatch's run list (one line per run, in the run "
                             "order) and exit; submit it with sbatch --array=0-<lines-1>")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value for every run")
    args = parser.parse_args(argv)
    if args.study == "precision" and args.variants:
        unknown = sorted(set(args.variants) - set(VARIANTS))
        if unknown:
            parser.error(f"unknown variants {unknown}; the precision study has {sorted(VARIANTS)}")
    base, runs, runs_dir, out, title = _plan(args)
    root, out = Path(args.runs_dir or runs_dir), args.out or out
    extra = list(args.overrides) + ([f"train.num_steps={args.steps}"] if args.steps else [])
    declared = {"heldout": (HELDOUT_SEEDS, None), "rivals": (RIVAL_SEEDS, list(RIVAL_ARMS)[:RIVAL_PRIMARY])}
    if args.study == "surge" and args.stage in declared:
        default_seeds, primary = declared[args.stage]
        seeds = args.seeds or default_seeds
        jobs = heldout_jobs(runs, seeds, primary)
    else:
        seeds = args.seeds or [1]
        jobs = [(v, s) for s in seeds for v in runs]
    if args.write_sweep:
        lines = [" ".join([f"{v}_seed{s}", *runs[v], f"train.seed={s}", *extra]) for v, s in jobs]
        Path(args.write_sweep).write_text("\n".join(lines) + "\n")
        print(f"{args.write_sweep}: {len(lines)} runs; sbatch --array=0-{len(lines) - 1} slurm/sweep.sbatch "
              f"{args.write_sweep} {base.relative_to(HERE.parents[1])}")
        return 0
    with ThreadPoolExecutor(args.jobs) as pool:  # a failed run does not cancel the others
        futures = [pool.submit(run_one, v, runs[v], base, s, root, extra) for v, s in jobs]
    done, failed = [], []
    for (v, s), fut in zip(jobs, futures):
        (failed if fut.exception() else done).append((v, s, fut))
    for v, s, fut in failed:
        print(f"FAILED: {fut.exception()}", file=sys.stderr)
    if not done:
        return 1
    from megatron_rl.telemetry.report import load_runs, write_report

    loaded = load_runs([f.result() for _, _, f in done], [f"{v} s{s}" for v, s, _ in done])
    print(write_report(loaded, out, title))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
