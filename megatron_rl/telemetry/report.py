"""Comparison report (Markdown + PNG figures) over any set of runs, from their metrics.jsonl files."""

from __future__ import annotations

import math
import re
from pathlib import Path

from megatron_rl.telemetry.plotting import plot_runs
from megatron_rl.telemetry.logger import read_jsonl

FIGURES = {
    "learning.png": (("reward/mean", "reward"), ("entropy", "entropy"),
                     ("response_length/mean", "response length"), ("grad_norm", "grad norm")),
    "clipping.png": (("clip/low_neg", "lower-clip fraction, A<0"),
                     ("clip/high_pos", "upper-clip fraction, A>0"),
                     ("shadow/false_clip_low_neg", "false lower-clip rate, A<0 (vs BF16 shadow)"),
                     ("noise/log_ratio_std_at_old", "std log r at theta_old (precision noise)")),
    "health.png": (("entropy", "entropy"), ("health/garbled_rate", "garbled-output rate (format check)"),
                   ("reward/mean", "reward"), ("response_length/mean", "response length")),
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
    ("std log r at old", "noise/log_ratio_std_at_old", "all"),
    ("clip low A<0 at old", "noise/clip_low_neg_at_old", "all"),
    ("clip low A<0", "clip/low_neg", "all"),
    ("clip high A>0", "clip/high_pos", "all"),
    ("shadow: FP8 clip low A<0", "shadow/clip_low_neg_fp8", "all"),
    ("shadow: BF16 clip low A<0", "shadow/clip_low_neg_bf16", "all"),
    ("shadow: false clip A<0", "shadow/false_clip_low_neg", "all"),
    ("shadow: missed clip A<0", "shadow/missed_clip_low_neg", "all"),
    ("oos: false clip A<0", "calib/oos_false_clip_low", "all"),
    ("oos: missed clip A<0", "calib/oos_missed_clip_low", "all"),
    ("calib skipped", "calib/skipped", "all"),
    ("H kept", "calib/high_kept", "all"),
    ("mismatch mean exp(abs dlogp)", "mismatch/token_mult_prob_error", "all"),
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


_EVAL_KEY = re.compile(r"eval/([^/]+)/((avg|pass|maj)@([0-9]+))")  # the rollout-precision scores
_KIND_ORDER = {"avg": 0, "pass": 1, "maj": 2}


def eval_columns(runs: dict[str, list[dict]]) -> list[tuple[str, str, str]]:
    """(title, key, reduction) of the held-out columns: for every eval dataset the runs log (named
    as configured in eval.datasets), its headline metric (the first avg@k, else pass@k, else maj@k)
    at the first evaluation (eval.at_start: before any update) and the last (eval.at_end)."""
    metrics: dict[str, set[tuple[int, int, str]]] = {}
    for records in runs.values():
        for key in {k for r in records for k in r}:
            match = _EVAL_KEY.fullmatch(key)
            if match:
                name, metric, kind, k = match.groups()
                metrics.setdefault(name, set()).add((_KIND_ORDER[kind], int(k), metric))
    columns = []
    for name in sorted(metrics):
        metric = min(metrics[name])[2]
        columns += [(f"{name} {metric} {how}", f"eval/{name}/{metric}", how) for how in ("first", "last")]
    return columns


# Health columns (docs/health.md), after TABLE's: surge step, garbled rate last quarter, max rise.
HEALTH_TITLES = ("surge step", "garbled rate, last quarter", "max entropy rise")


def surge_step_cell(records: list[dict]) -> str:
    """The first surge's onset step; "-" for a run with health metrics but no surge, "" without them."""
    steps = _values(records, "health/surge_step")
    if steps:
        return str(int(steps[0]))
    return "-" if _values(records, "health/rise_streak") else ""


def _number(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.4g}"


def summary_table(runs: dict[str, list[dict]]) -> str:
    """Markdown table, one row per run; empty cells where a run does not log the metric. The
    held-out columns follow the training reward's."""
    table = [*TABLE[:2], *eval_columns(runs), *TABLE[2:]]
    titles = [t for t, _, _ in table] + list(HEALTH_TITLES)
    head = "| run | " + " | ".join(titles) + " |"
    rule = "|---" * (len(titles) + 1) + "|"
    rows = [head, rule]
    for name, records in runs.items():
        cells = [_number(reduce_column(records, key, how)) for _, key, how in table]
        cells += [surge_step_cell(records), _number(reduce_column(records, "health/garbled_rate", "last")),
                  _number(reduce_column(records, "health/entropy_rise", "max"))]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# Rows of the claims table (paper.md section 4): (claim, what is measured, metric key). Every value
# averages the steps that log the key (shadow metrics: calibration/diagnose steps only) and seeds.
CLAIMS = (
    ("1", "std of log r at theta_old (pure precision noise)", "noise/log_ratio_std_at_old"),
    ("1", "lower-clip fraction A<0 at theta_old", "noise/clip_low_neg_at_old"),
    ("2", "lower-clip A<0 with the FP8 ratio (shadow batch)", "shadow/clip_low_neg_fp8"),
    ("2", "lower-clip A<0 with the BF16 ratio (same tokens)", "shadow/clip_low_neg_bf16"),
    ("2", "upper-clip A>0 with the FP8 ratio (shadow batch)", "shadow/clip_high_pos_fp8"),
    ("2", "upper-clip A>0 with the BF16 ratio (same tokens)", "shadow/clip_high_pos_bf16"),
    ("3", "false lower-clip rate P(r8 < L, r16 >= 1-eps; A<0)", "shadow/false_clip_low_neg"),
    ("3", "share of zero-gradient A<0 tokens that are false", "shadow/false_clip_share"),
    ("3", "missed lower-clip rate P(r8 >= L, r16 < 1-eps; A<0)", "shadow/missed_clip_low_neg"),
    ("3", "false upper-clip rate P(r8 > H, r16 <= 1+eps; A>0)", "shadow/false_clip_high_pos"),
    ("3", "missed upper-clip rate P(r8 <= H, r16 > 1+eps; A>0)", "shadow/missed_clip_high_pos"),
    ("5", "BF16 lower-clip quantile alpha", "calib/alpha"),
    ("5", "calibrated L (applied)", "calib/low"),
    ("5", "calibrated H (applied)", "calib/high"),
    ("5", "in-sample: FP8 lower-clip at the new L (fitting batch)", "calib/is_clip_low_fp8"),
    ("5", "out-of-sample: FP8 lower-clip at L, next calibration batch", "calib/oos_clip_low_fp8"),
    ("5", "out-of-sample: BF16 lower-clip on that batch", "calib/oos_clip_low_bf16"),
    ("5", "out-of-sample: false lower-clip rate at L", "calib/oos_false_clip_low"),
    ("5", "out-of-sample: missed lower-clip rate at L", "calib/oos_missed_clip_low"),
    ("5", "out-of-sample: false upper-clip rate at H", "calib/oos_false_clip_high"),
    ("5", "out-of-sample: missed upper-clip rate at H", "calib/oos_missed_clip_high"),
    ("5", "fraction of calibrations skipped", "calib/skipped"),
    ("5", "fraction with H kept (unattainable / BF16 clips ~nothing / end bin)", "calib/high_kept"),
    ("5", "fraction with H unattainable", "calib/high_unattainable"),
    ("5", "fraction with L or H clamped into range", "calib/clamped"),
    ("7", "pos/neg balance, BF16 bounds on BF16 ratio", "calib/balance_bf16"),
    ("7", "pos/neg balance, calibrated bounds on FP8 ratio", "calib/balance_fp8"),
    ("7", "in-sample balance error FP8 / BF16 - 1 (fitting batch)", "calib/is_balance_err"),
    ("7", "out-of-sample balance error, next calibration batch", "calib/oos_balance_err"),
    ("7", "pos/neg balance, default bounds on FP8 ratio (diagnose)", "diag/balance_fp8"),
    ("7", "pos/neg balance, BF16 (diagnose)", "diag/balance_bf16"),
    ("4/8", "max entropy over the run (TIS on in every run)", "entropy"),
    ("4/6", "reward, last quarter of the steps", "reward/mean"),
    ("6", "response length, last quarter", "response_length/mean"),
)


_SEED_SUFFIX = re.compile(r"(.+) s[0-9]+")


def _variant(label: str) -> str:
    """'fp8_tensorwise s2' -> 'fp8_tensorwise': seeds of one variant are averaged. Only a trailing
    ' s<number>' names a seed ('gspo seq-cc' is a variant of its own, not a seed of 'gspo')."""
    match = _SEED_SUFFIX.fullmatch(label)
    return match.group(1) if match else label


def claims_table(runs: dict[str, list[dict]]) -> str:
    """Markdown: one row per measurement, one column per variant (seeds averaged)."""
    variants: dict[str, list[list[dict]]] = {}
    for label, records in runs.items():
        variants.setdefault(_variant(label), []).append(records)
    names = list(variants)
    rows = ["| claim | measurement | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for claim, text, key in CLAIMS:
        how = "max" if text.startswith("max") else "last" if "last quarter" in text else "all"
        cells = []
        for name in names:
            vals = [reduce_column(r, key, how) for r in variants[name]]
            vals = [v for v in vals if not math.isnan(v)]
            cells.append(f"{sum(vals) / len(vals):.4g}" if vals else "")
        rows.append(f"| {claim} | {text} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def load_runs(run_dirs: list[str | Path], labels: list[str] | None = None) -> dict[str, list[dict]]:
    runs, folders = {}, {}
    for i, d in enumerate(run_dirs):
        path = Path(d) / "metrics.jsonl"
        if not path.is_file():
            raise ValueError(f"no metrics.jsonl in run folder {d}")
        label = labels[i] if labels else Path(d).name
        if label in folders:  # one would silently replace the other in the tables
            raise ValueError(f"run folders {folders[label]} and {d} have the same label {label!r}: "
                             "give each run its own (--labels)")
        folders[label] = d
        runs[label] = read_jsonl(path)
    return runs


def write_report(runs: dict[str, list[dict]], out_dir: str | Path, title: str = "Run comparison") -> Path:
    """Write report.md and the figures into `out_dir`; returns the Markdown path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", "## Per run", "", summary_table(runs), "",
             "## Measurements behind the paper's claims (paper.md section 4)", "", claims_table(runs), ""]
    for name, panels in FIGURES.items():
        plot_runs(runs, out_dir / name, panels)
        lines += [f"![{name[:-4]}]({name})", ""]
    lines += ["Columns: `last` values average the last quarter of the steps; clip and false-clip "
              "columns average every step that logs them (false-clip needs the BF16 shadow, "
              "so it exists on shadow steps only). Health columns (docs/health.md): the first "
              "entropy surge's onset step (- for none), the garbled-output rate of the last quarter "
              "and the largest entropy rise over the run's minimum.", ""]
    md = out_dir / "report.md"
    md.write_text("\n".join(lines))
    return md
