"""Tables and figure of the held-out surge study (docs/reproduction.md, "Does Calibrated Clipping help
beyond TIS?") from the finished runs of `run.py --study surge --stage heldout`:

  python examples/reproduce/heldout_stats.py [--runs-dir runs/surge_heldout] [--out docs/reproduction/surge/heldout]
  python examples/reproduce/heldout_stats.py --runs-dir runs/sweep     # the same grid run by slurm/sweep.sbatch
  python examples/reproduce/heldout_stats.py --study rivals             # the second study (--stage rivals)

Writes report.md (per-arm table, Fisher tests, per-run table) and heldout.png (held-out avg@4 over
steps, mean and +-1 standard deviation across seeds, in the rollout precision and in BF16).
Statistics as declared: megatron_rl/telemetry/stats.py.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import HELDOUT_ARMS, HELDOUT_REFERENCE, HELDOUT_SEEDS, RIVAL_ARMS, RIVAL_REFERENCE, RIVAL_SEEDS  # noqa: E402

from megatron_rl.telemetry.logger import read_jsonl  # noqa: E402
from megatron_rl.telemetry.stats import bootstrap_diff_ci, fisher_exact  # noqa: E402

ACC = "eval/heldout/avg@4"
ACC_BF16 = "eval/heldout/bf16/avg@4"
FISHER_PAIRS = [("heldout_nvfp4_tis", "heldout_nvfp4_calibrated_tis"),  # primary
                ("heldout_nvfp4_gspo_tis", "heldout_nvfp4_gspo_seq_calibrated_tis"),
                *((arm, "heldout_bf16_tis") for arm in HELDOUT_ARMS if arm != "heldout_bf16_tis")]
# The studies this script reports: (arms, reference arm, declared seeds, Fisher pairs, title, runs, out).
STUDIES = {
    "heldout": (HELDOUT_ARMS, HELDOUT_REFERENCE, HELDOUT_SEEDS, FISHER_PAIRS,
                "Held-out surge study: does Calibrated Clipping help beyond TIS?",
                "runs/surge_heldout", "docs/reproduction/surge/heldout"),
    "rivals": (RIVAL_ARMS, RIVAL_REFERENCE, RIVAL_SEEDS,
               [(RIVAL_REFERENCE, arm) for arm in RIVAL_ARMS if arm != RIVAL_REFERENCE],
               "Second held-out study: Calibrated Clipping against its cheapest rivals",
               "runs/surge_rivals", "docs/reproduction/surge/rivals"),
}


def finished(run_dir: Path) -> bool:
    """The harness's `done` marker, or (a run of slurm/sweep.sbatch) a last logged step that is the
    run's last (train.num_steps of its config.yaml)."""
    if (run_dir / "done").exists():
        return True
    if not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "config.yaml").is_file():
        return False
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["num_steps"]
    return bool(records) and records[-1]["step"] + 1 == steps


def load(runs_dir: Path, arms=HELDOUT_ARMS) -> dict[str, dict[int, list[dict]]]:
    """arm -> seed -> records, finished runs only."""
    out: dict[str, dict[int, list[dict]]] = {arm: {} for arm in arms}
    for d in sorted(runs_dir.glob("*_seed*")):
        m = re.fullmatch(r"(.+)_seed(\d+)", d.name)
        if m and m[1] in out and finished(d):
            out[m[1]][int(m[2])] = read_jsonl(d / "metrics.jsonl")
    return out


def evals(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(updates before the evaluation, value): an evaluation at the top of step s saw s updates; the
    one after the last step (eval.at_end, logged on its row) saw all of them."""
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if pts and records and pts[-1][0] == records[-1]["step"]:
        pts[-1] = (pts[-1][0] + 1, pts[-1][1])
    return pts


def final(records: list[dict], key: str) -> float:
    pts = evals(records, key)
    return pts[-1][1] if pts else math.nan


def first(records: list[dict], key: str) -> float:
    return next((r[key] for r in records if r.get(key) is not None), math.nan)


def _values(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if r.get(key) is not None]


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals) if vals else math.nan


def mean_of(records: list[dict], key: str) -> float:
    return _mean(_values(records, key))


def first_quarter(records: list[dict], key: str) -> float:
    vals = _values(records, key)
    return _mean(vals[:max(1, len(vals) // 4)])


def last_quarter(records: list[dict], key: str) -> float:
    vals = _values(records, key)
    return _mean(vals[-max(1, len(vals) // 4):])


def onsets(runs: dict[int, list[dict]], key: str) -> list[int]:
    return sorted(int(v) for recs in runs.values() if (v := first(recs, key)) == v)  # v == v: not NaN


def fmt(x: float, digits: int = 3) -> str:
    return "" if x != x else f"{x:.{digits}f}"


def ci_cell(a: list[float], b: list[float]) -> str:
    if len(a) < 2 or len(b) < 2:
        return "(too few runs)"
    diff, low, high = bootstrap_diff_ci(a, b)
    return f"{diff:+.3f} [{low:+.3f}, {high:+.3f}]"


def arm_table(data: dict[str, dict[int, list[dict]]], reference: str = HELDOUT_REFERENCE) -> str:
    ref = data[reference]
    ref_acc = [final(r, ACC) for r in ref.values()]
    ref_bf16 = [final(r, ACC_BF16) for r in ref.values()]
    head = ("| arm | seeds | entropy surges (onsets) | garbled surges (onsets) | held-out avg@4 start -> end "
            f"| end minus {reference} [95% CI] | held-out avg@4 in BF16, end | BF16 end minus reference "
            "[95% CI] | pass@4 end | eval gap rollout - BF16, end | held-out garbled, end | false lower clip A<0 "
            "| reward first -> last quarter |")
    rows = [head, "|" + "---|" * 13]
    for arm, runs in data.items():
        if not runs:
            rows.append(f"| {arm} | 0 | | | | | | | | | | | |")
            continue
        recs = list(runs.values())
        n = len(recs)
        ent, gar = onsets(runs, "health/surge_step"), onsets(runs, "health/garbled_surge_step")
        acc = [final(r, ACC) for r in recs]
        bf16 = [final(r, ACC_BF16) for r in recs]

        def avg(f, key):
            return _mean([v for r in recs if (v := f(r, key)) == v])  # v == v: not NaN

        rows.append(
            f"| {arm} | {n} ({','.join(map(str, sorted(runs)))}) | {len(ent)}/{n} {tuple(ent) if ent else ''} "
            f"| {len(gar)}/{n} {tuple(gar) if gar else ''} | {fmt(avg(first, ACC))} -> {fmt(statistics.mean(acc))} "
            f"| {'' if arm == reference else ci_cell(acc, ref_acc)} | {fmt(statistics.mean(bf16))} "
            f"| {'' if arm == reference else ci_cell(bf16, ref_bf16)} | {fmt(avg(final, 'eval/heldout/pass@4'))} "
            f"| {fmt(avg(final, 'eval/heldout/rollout_minus_bf16/avg@4'), 3)} | {fmt(avg(final, 'eval/heldout/garbled_rate'))} "
            f"| {fmt(avg(mean_of, 'shadow/false_clip_low_neg'), 4)} "
            f"| {fmt(avg(first, 'reward/mean'))} -> {fmt(avg(last_quarter, 'reward/mean'))} |")
    return "\n".join(rows)


MECHANISM = [  # (column, statistic, metric): what each arm's clipping did, and where the policy went
    ("lower bound, mean", mean_of, "calib/low"),
    ("clipped low A<0 (FP8)", mean_of, "clip/low_neg"),
    ("false lower clip A<0", mean_of, "shadow/false_clip_low_neg"),
    ("log-ratio std FP8", mean_of, "shadow/log_ratio_fp8_std"),
    ("log-ratio std BF16", mean_of, "shadow/log_ratio_bf16_std"),
    ("rollout mismatch, first quarter", first_quarter, "mismatch/abs_logprob_diff"),
    ("rollout mismatch, last quarter", last_quarter, "mismatch/abs_logprob_diff"),
    ("entropy, first quarter", first_quarter, "entropy"),
    ("entropy, last quarter", last_quarter, "entropy"),
]


def mechanism_table(data: dict[str, dict[int, list[dict]]]) -> str:
    """Seed means per arm of what the clipping did and how far the trainer drifted from the engine
    (mismatch: mean |log p_trainer - log p_rollout| per token, before the update)."""
    rows = ["| arm | " + " | ".join(c for c, _, _ in MECHANISM) + " |", "|" + "---|" * (len(MECHANISM) + 1)]
    for arm, runs in data.items():
        if not runs:
            continue
        cells = []
        for _, stat, key in MECHANISM:
            vals = [v for recs in runs.values() if (v := stat(recs, key)) == v]
            cells.append(fmt(statistics.mean(vals), 3) if vals else "")
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def fisher_table(data: dict[str, dict[int, list[dict]]], pairs=FISHER_PAIRS) -> str:
    rows = ["| arms | entropy rule: surges, p | garbled rule: surges, p |", "|---|---|---|"]
    for a, b in pairs:
        ra, rb = data[a], data[b]
        if not ra or not rb:
            continue
        cells = []
        for key in ("health/surge_step", "health/garbled_surge_step"):
            ea, eb = len(onsets(ra, key)), len(onsets(rb, key))
            cells.append(f"{ea}/{len(ra)} vs {eb}/{len(rb)}, p = {fisher_exact(ea, len(ra), eb, len(rb)):.3f}")
        rows.append(f"| {a} vs {b} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run_table(data: dict[str, dict[int, list[dict]]]) -> str:
    rows = ["| run | held-out avg@4 by eval step (rollout precision) | BF16 | entropy max | max entropy rise |",
            "|---|---|---|---|---|"]
    for arm, runs in data.items():
        for seed, recs in sorted(runs.items()):
            by_step = ", ".join(f"{s}: {v:.2f}" for s, v in evals(recs, ACC))
            bf16 = ", ".join(f"{v:.2f}" for _, v in evals(recs, ACC_BF16))
            ent = [r["entropy"] for r in recs if r.get("entropy") is not None]
            rise = [r["health/entropy_rise"] for r in recs if r.get("health/entropy_rise") is not None]
            rows.append(f"| {arm} s{seed} | {by_step} | {bf16} | {fmt(max(ent) if ent else math.nan)} "
                        f"| {fmt(max(rise) if rise else math.nan)} |")
    return "\n".join(rows)


def plot(data: dict[str, dict[int, list[dict]]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key, title in ((axes[0], ACC, "held-out avg@4, rollout precision"),
                           (axes[1], ACC_BF16, "held-out avg@4, same weights in BF16")):
        for i, (arm, runs) in enumerate(data.items()):
            curves = [dict(evals(recs, key)) for recs in runs.values()]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            mean = [statistics.mean(c[s] for c in curves) for s in steps]
            sd = [statistics.pstdev([c[s] for c in curves]) for s in steps]
            color = colors[i % len(colors)]
            ax.plot(steps, mean, color=color, linewidth=1.8, marker="o", markersize=3,
                    label=f"{arm.removeprefix('heldout_')} (n={len(curves)})")
            ax.fill_between(steps, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                            color=color, alpha=0.15, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel("updates")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("avg@4 (mean +- 1 sd across seeds)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", choices=sorted(STUDIES), default="heldout",
                        help="heldout (run.py --stage heldout) or rivals (--stage rivals)")
    parser.add_argument("--runs-dir", default=None, help="default: the study's (runs/surge_heldout, runs/surge_rivals)")
    parser.add_argument("--out", default=None, help="default: docs/reproduction/surge/<study>")
    args = parser.parse_args(argv)
    arms, reference, seeds, pairs, title, runs_dir, out_dir = STUDIES[args.study]
    args.runs_dir, args.out = args.runs_dir or runs_dir, args.out or out_dir
    data = load(Path(args.runs_dir), arms)
    done = sum(len(r) for r in data.values())
    if not done:
        raise SystemExit(f"no finished runs of the held-out study in {args.runs_dir}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(data, out / "heldout.png")
    declared = len(arms) * len(seeds)
    lines = [f"# {title}", "",
             f"{done} of the {declared} declared runs finished (seeds {seeds[0]}-{seeds[-1]} "
             "per arm; docs/reproduction.md has the declaration).", "",
             "## Per arm", "", arm_table(data, reference), "",
             "Held-out accuracy: the last evaluation (after the last update), 128 held-out chain prompts x 4 "
             "samples; intervals: bootstrap 95% of the difference of arm means (seeds resampled within each "
             "arm, 10,000 resamples). False lower clip: mean over the BF16-shadow steps (token arms: "
             "token ratios; GSPO arms: sequence ratios).", "",
             "## Surge counts (two-sided Fisher exact test)", "", fisher_table(data, pairs), "",
             "## What the clipping did (seed means)", "", mechanism_table(data), "",
             "Over every step of each run; the shadow columns over the BF16-shadow steps; first / last quarter: "
             "of the logged steps.", "",
             "![held-out accuracy](heldout.png)", "", "## Per run", "", run_table(data), ""]
    (out / "report.md").write_text("\n".join(lines))
    print(out / "report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
