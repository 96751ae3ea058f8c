"""Value tests of telemetry/health: the surge detector against a reference written from docs/health.md
over random traces that hit the thresholds exactly (ties count as over), with gaps (NaN, missing)
and a warm-up; and a resume from the history giving the same metrics as the uninterrupted run."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.telemetry.health import MIN_ENTROPY, SurgeDetector

# Entropies on a grid where rise = e / min - 1 lands exactly on the 0.5 threshold (1.0 -> 1.5).
ENTROPY = st.sampled_from([1.0, 1.5, 2.0, 0.5, 0.75, 3.0, math.nan, None, 0.0])
GARBLED = st.sampled_from([0.0, 0.5, 0.25, 1.0, None])


def _reference(trace, rise_t, patience, warmup, garbled_t):
    out, m, streak, onset, first, g_streak, g_onset, g_first = [], None, 0, None, None, 0, None, None
    for step, (e, g) in enumerate(trace):
        row = {}
        if e is not None and not math.isnan(e) and step >= warmup:
            m = e if m is None else min(m, e)
            rise = e / max(m, MIN_ENTROPY) - 1.0
            if rise >= rise_t:
                streak, onset = streak + 1, step if onset is None else onset
                first = onset if streak >= patience and first is None else first
            else:
                streak, onset = 0, None
            row["health/entropy_min"], row["health/entropy_rise"] = m, rise
        row["health/rise_streak"], row["health/surge"] = float(streak), float(streak >= patience)
        if first is not None:
            row["health/surge_step"] = float(first)
        if g is not None:
            if g >= garbled_t:
                g_streak, g_onset = g_streak + 1, step if g_onset is None else g_onset
                g_first = g_onset if g_streak >= patience and g_first is None else g_first
            else:
                g_streak, g_onset = 0, None
            row["health/garbled_streak"], row["health/garbled_surge"] = float(g_streak), float(g_streak >= patience)
            if g_first is not None:
                row["health/garbled_surge_step"] = float(g_first)
        out.append(row)
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(ENTROPY, GARBLED), min_size=1, max_size=14), st.integers(1, 3), st.integers(0, 3))
def test_surge_detector_matches_the_documented_rule_and_resumes_from_its_history(trace, patience, warmup):
    detector = SurgeDetector(entropy_rise=0.5, patience=patience, warmup_steps=warmup, garbled_rate=0.5)
    got, history = [], []
    for step, (e, g) in enumerate(trace):
        metrics = {k: v for k, v in (("entropy", e), ("health/garbled_rate", g)) if v is not None}
        got.append(detector.update(step, metrics))
        history.append({"step": step, **metrics})
    assert got == _reference(trace, 0.5, patience, warmup, 0.5)
    health = type("H", (), {"entropy_rise": 0.5, "patience": patience, "warmup_steps": warmup, "garbled_rate": 0.5})
    half = len(trace) // 2
    resumed = SurgeDetector.from_history(health, history[:half])
    assert [resumed.update(r["step"], r) for r in history[half:]] == got[half:]


def test_the_summary_takes_the_first_and_the_mean_of_the_last_five_logged_values(tmp_path):
    from megatron_rl.telemetry.logger import MetricsLogger, read_jsonl

    log = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    values = [1.0, 2.0, float("nan"), 4.0, 5.0, 6.0, 7.0, 8.0]  # the NaN step is logged as null, not averaged
    for step, v in enumerate(values):
        log.log(step, {"reward/mean": v, "entropy": 0.5})
    log.close()
    assert [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [*values[:2], None, *values[3:]]
    row = next(line for line in log.summary().splitlines() if line.startswith("reward/mean"))
    assert row.split()[1:] == ["1.0000", f"{(4 + 5 + 6 + 7 + 8) / 5:.4f}"]
    assert "clip/low_neg" not in log.summary()  # never logged: no row
