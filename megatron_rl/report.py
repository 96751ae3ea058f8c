"""Comparison report (Markdown + PNG figures) over any set of runs, from their metrics.jsonl files."""

from __future__ import annotations

import math
from pathlib import Path

from megatron_rl.plotting import plot_runs
from megatron_rl.telemetry import read_jsonl

FIGURES = {
    "learning.png": (("reward/mean", "reward"), ("entropy", "entropy"),
                     ("response_length/mean", "response length"), ("grad_norm", "grad norm")),
    "clipping.png": (("clip/low_neg", "lower-clip fraction, A<0 (FP8 ratio)"),
                     ("clip/high_pos", "upper-clip fraction, A>0"),
                     ("false_clip/low_neg", "false lower-clip rate, A<0 (vs BF16 shadow)"),
                     ("shadow/log_ratio_fp8_std", "std log r: FP8 (shadow steps)")),
    "bounds.png": (("calib/low", "lower bound L"), ("calib/high", "upper bound H"),
                   ("calib/balance_fp8", "pos/neg update balance, FP8"),
                   ("calib/balance_bf16", "pos/neg update balance, BF16")),
}

# (column title, metric key, reduction): "last" = mean of the last quarter of steps,
# "first" = first logged value, "all" = mean over every step where the key is present.
TABLE = (
    ("reward first", "reward/mean", "first"),
    ("reward last", "reward/mean", "last"),
    ("entropy last", "entropy", "last"),
    ("entropy max", "entropy", "max"),
    ("resp len last", "response_length/mean", "last"),
    ("std log r at old (FP8 noise)", "noise/log_ratio_std_at_old", "all"),
    ("clip low A<0", "clip/low_neg", "all"),
    ("clip high A>0", "clip/high_pos", "all"),
    ("BF16 clip low A<0", "ref_clip/low_neg", "all"),
    ("false clip A<0", "false_clip/low_neg", "all"),
    ("mismatch exp|dlogp|", "mismatch/token_mult_prob_error", "all"),
    ("L mean", "calib/low", "all"),
    ("H mean", "calib/high", "all"),
)


def _values(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if r.get(key) is not None]


def reduce_column(records: list[dict], key: str, how: str) -> float:
    vals = _values(records, key)
    if not vals:
        return math.nan
    if how == "first":
        return vals[0]
    if how == "max":
        return max(vals)
    if how == "last":
        vals = vals[-max(1, len(vals) // 4):]
    return sum(vals) / len(vals)


def summary_table(runs: dict[str, list[dict]]) -> str:
    """Markdown table, one row per run; empty cells where a run does not log the metric."""
    head = "| run | " + " | ".join(t for t, _, _ in TABLE) + " |"
    rule = "|---" * (len(TABLE) + 1) + "|"
    rows = [head, rule]
    for name, records in runs.items():
        cells = [reduce_column(records, key, how) for _, key, how in TABLE]
        rows.append(f"| {name} | " + " | ".join("" if math.isnan(c) else f"{c:.4g}" for c in cells) + " |")
    return "\n".join(rows)


def load_runs(run_dirs: list[str | Path], labels: list[str] | None = None) -> dict[str, list[dict]]:
    runs = {}
    for i, d in enumerate(run_dirs):
        path = Path(d) / "metrics.jsonl"
        if not path.is_file():
            raise ValueError(f"no metrics.jsonl in run folder {d}")
        runs[labels[i] if labels else Path(d).name] = read_jsonl(path)
    return runs


def write_report(runs: dict[str, list[dict]], out_dir: str | Path, title: str = "Run comparison") -> Path:
    """Write report.md and the figures into `out_dir`; returns the Markdown path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", summary_table(runs), ""]
    for name, panels in FIGURES.items():
        plot_runs(runs, out_dir / name, panels)
        lines += [f"![{name[:-4]}]({name})", ""]
    lines += ["Columns: `last` values average the last quarter of the steps; clip and false-clip "
              "columns average every step that logs them (false-clip needs the BF16 shadow, "
              "so it exists on shadow steps only).", ""]
    md = out_dir / "report.md"
    md.write_text("\n".join(lines))
    return md
