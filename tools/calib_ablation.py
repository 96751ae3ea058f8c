"""Replay saved calibration histograms through controllers with other knobs (offline ablation).

A run with `calib.dump_dir` saves every reduced calibration histogram. This tool feeds one run's
histograms, in step order, to a fresh CalibratedClipController per setting (balance x smoothing)
and reports the out-of-sample scores: the bounds fitted on one calibration batch, scored on the
next one before refitting (the calib/oos_* metrics). The training run itself is not replayed: the
batches are those of the recorded run, whatever bounds it applied.

  python tools/calib_ablation.py runs/reproduce/*/calib --every 5 > ablation.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from megatron_rl.algo.calib_solve import Rules
from megatron_rl.algo.calibrated_clip import CalibratedClipController
from megatron_rl.algo.ratio_histogram import BALANCES, RatioHistogram


def load_histograms(directory: Path) -> list[dict]:
    """The saved histograms of one run, in step order."""
    return [torch.load(p, weights_only=True) for p in sorted(directory.glob("calib_*.pt"))]


def _histogram(saved: dict) -> RatioHistogram:
    hist = RatioHistogram(saved["eps_low"], saved["eps_high"], saved["num_bins"], saved["log_ratio_range"])
    hist.payload, hist.reduced = saved["payload"].clone(), True
    return hist


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def replay(saved: list[dict], balance: str, smoothing: float, rules: Rules) -> dict[str, float]:
    """Scores of one setting over one run's histograms."""
    first = saved[0]
    ctrl = CalibratedClipController(first["eps_low"], first["eps_high"], num_bins=first["num_bins"],
                                    log_ratio_range=first["log_ratio_range"], smoothing=smoothing,
                                    rules=rules._replace(balance=balance))
    rows = [ctrl.update_from_histogram(_histogram(s)) for s in saved]
    oos = [r for r in rows if "calib/oos_clip_low_fp8" in r]
    lows, highs = [r["calib/low"] for r in rows], [r["calib/high"] for r in rows]
    kept = ("unattainable", "edge", "no_bf16_upper_clip", "undefined")
    return {
        "calibrations": len(rows),
        "skipped": _mean([r["calib/skipped"] for r in rows]),
        "high_kept": _mean([float(any(r.get(f"calib/high_{k}", 0.0) for k in kept)) for r in rows]),
        "high_unattainable": _mean([r.get("calib/high_unattainable", 0.0) for r in rows]),
        "low_clamped": _mean([r.get("calib/low_clamped", 0.0) for r in rows]),
        "L_mean": _mean(lows), "L_jump": _mean([abs(a - b) for a, b in zip(lows, lows[1:])]),
        "H_mean": _mean(highs), "H_jump": _mean([abs(a - b) for a, b in zip(highs, highs[1:])]),
        "oos_alpha_gap": _mean([abs(r["calib/oos_clip_low_fp8"] - r["calib/oos_clip_low_bf16"]) for r in oos]),
        "oos_false_clip_low": _mean([r["calib/oos_false_clip_low"] for r in oos]),
        "oos_missed_clip_low": _mean([r["calib/oos_missed_clip_low"] for r in oos]),
        "oos_false_clip_high": _mean([r["calib/oos_false_clip_high"] for r in oos]),
        "oos_missed_clip_high": _mean([r["calib/oos_missed_clip_high"] for r in oos]),
        "oos_high_gap": _mean([abs(r["calib/oos_clip_high_fp8"] - r["calib/oos_clip_high_bf16"]) for r in oos]),
        "oos_abs_balance_err": _mean([abs(r["calib/oos_balance_err"]) for r in oos]),
        "default_false_clip_low": _mean([r.get("calib/default_false_clip_low") for r in rows]),
        "default_missed_clip_low": _mean([r.get("calib/default_missed_clip_low") for r in rows]),
        "default_false_clip_high": _mean([r.get("calib/default_false_clip_high") for r in rows]),
        "default_missed_clip_high": _mean([r.get("calib/default_missed_clip_high") for r in rows]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="calib dump directories, one per run")
    parser.add_argument("--every", type=int, default=1, help="use every n-th saved histogram (a longer period)")
    parser.add_argument("--balances", nargs="*", default=list(BALANCES), choices=list(BALANCES))
    parser.add_argument("--smoothing", nargs="*", type=float, default=[1.0, 0.5, 0.25])
    parser.add_argument("--tolerance-tokens", nargs="*", type=float, default=[Rules().alpha_tolerance_tokens])
    args = parser.parse_args(argv)
    runs = {d: load_histograms(Path(d))[:: args.every] for d in args.dirs}
    results = []
    for balance, smoothing, tokens in itertools.product(args.balances, args.smoothing, args.tolerance_tokens):
        rules = Rules(alpha_tolerance_tokens=tokens)
        per_run = [replay(saved, balance, smoothing, rules) for saved in runs.values() if len(saved) > 1]
        mean = {k: _mean([r[k] for r in per_run]) for k in per_run[0]}
        results.append({"balance": balance, "smoothing": smoothing, "tolerance_tokens": tokens,
                        "runs": len(per_run), **mean})
    json.dump(results, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
