"""Value tests of telemetry/: every column of the report's two tables against a reference reduction
over runs whose first, last-quarter, max and all-steps values all differ; seeds of a variant
grouped by their label alone (names are identity: "gspo seq-cc" is not a seed of "gspo"); two run
folders of one name refused instead of one silently replacing the other; the console line, the
resume history, the sample dumps and the statistics against independent references (scipy's
Fisher test, the bootstrap's exact small-sample distribution)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.telemetry import report
from megatron_rl.telemetry.logger import LINE_KEYS, MetricsLogger, read_jsonl, step_line
from megatron_rl.telemetry.report import CLAIMS, TABLE, claims_table, load_runs, summary_table

FAST = settings(max_examples=30, deadline=None)


def _reduce(values, how):
    """The documented reductions: first value, max, mean of the last quarter (at least one), mean."""
    if not values:
        return math.nan
    if how == "first":
        return values[0]
    if how == "max":
        return max(values)
    if how == "last":
        values = values[len(values) - max(1, len(values) // 4):]
    return sum(values) / len(values)


def _run(seed, steps=9, every=1):
    """Records where every key takes distinct values (key index, seed and step all matter); a key
    logged every `every` steps only, None on some steps."""
    keys = sorted({k for _, k, _ in TABLE} | {k for _, _, k in CLAIMS})
    records = []
    for s in range(steps):
        r = {"step": s}
        for i, key in enumerate(keys):
            if s % every == 0 and (s + i) % 5 != 3:
                r[key] = round(0.01 * (i + 1) + 0.1 * seed + 0.37 * ((s * 7 + i) % 11), 6)
            else:
                r[key] = None
        records.append(r)
    return records


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _number(value):
    return "" if math.isnan(value) else f"{value:.4g}"


def test_every_summary_column_is_its_reduction_of_the_run():
    runs = {"a": _run(0), "b": _run(1, steps=14, every=2)}
    for s, r in enumerate(runs["a"]):  # held-out scores on some steps of run a only: columns after the reward's
        r["eval/h/avg@4"] = 0.1 * s if s % 3 == 0 else None
        r["eval/h/pass@4"] = 1.0
    columns = [*TABLE[:2], ("h avg@4 first", "eval/h/avg@4", "first"), ("h avg@4 last", "eval/h/avg@4", "last"),
               *TABLE[2:]]
    lines = summary_table(runs).splitlines()
    head = _cells(lines[0])
    assert head[1:1 + len(columns)] == [t for t, _, _ in columns]
    for line, (name, records) in zip(lines[2:], runs.items()):
        cells = _cells(line)
        assert cells[0] == name
        for (title, key, how), cell in zip(columns, cells[1:]):
            values = [r[key] for r in records if r.get(key) is not None]
            assert cell == _number(_reduce(values, how)), (name, title)


def test_every_claims_row_reduces_each_seed_then_averages_the_seeds():
    runs = {"fp8 s1": _run(0), "fp8 s2": _run(1, steps=14), "fp8 s3": _run(2, steps=5, every=2), "bf16 s1": _run(3)}
    lines = claims_table(runs).splitlines()
    assert _cells(lines[0]) == ["claim", "measurement", "fp8", "bf16"]
    # the reduction each row states in its text: max, last quarter, or every step that logs the key
    hows = {"max entropy over the run (TIS on in every run)": "max",
            "reward, last quarter of the steps": "last", "response length, last quarter": "last"}
    for line, (claim, text, key) in zip(lines[2:], CLAIMS):
        how = hows.get(text, "all")
        cells = _cells(line)
        assert cells[:2] == [claim, text]
        for variant, cell in zip(("fp8", "bf16"), cells[2:]):
            per_seed = [_reduce([r[key] for r in recs if r.get(key) is not None], how)
                        for label, recs in runs.items() if label.startswith(variant + " ")]
            per_seed = [v for v in per_seed if not math.isnan(v)]
            assert cell == (f"{sum(per_seed) / len(per_seed):.4g}" if per_seed else ""), (text, variant)


def test_only_a_trailing_seed_number_groups_runs_into_a_variant():
    runs = {"gspo s1": [{"step": 0, "calib/low": 0.7}], "gspo s2": [{"step": 0, "calib/low": 0.9}],
            "gspo seq-cc": [{"step": 0, "calib/low": 0.5}], "nvfp4 sglang": [{"step": 0, "calib/low": 0.6}],
            "nvfp4": [{"step": 0, "calib/low": 0.2}]}
    lines = claims_table(runs).splitlines()
    assert _cells(lines[0])[2:] == ["gspo", "gspo seq-cc", "nvfp4 sglang", "nvfp4"]
    row = next(_cells(line) for line in lines if "calibrated L (applied)" in line)
    assert row[2:] == ["0.8", "0.5", "0.6", "0.2"]


def test_two_run_folders_with_one_name_are_refused_not_merged(tmp_path):
    for parent in ("seed1", "seed2"):
        (tmp_path / parent / "fp8").mkdir(parents=True)
        (tmp_path / parent / "fp8" / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    with pytest.raises(ValueError, match="fp8"):
        load_runs([tmp_path / "seed1" / "fp8", tmp_path / "seed2" / "fp8"])
    with pytest.raises(ValueError, match="same"):
        load_runs([tmp_path / "seed1" / "fp8", tmp_path / "seed2" / "fp8"], ["x", "x"])
    runs = load_runs([tmp_path / "seed1" / "fp8", tmp_path / "seed2" / "fp8"], ["fp8 s1", "fp8 s2"])
    assert list(runs) == ["fp8 s1", "fp8 s2"]


def test_the_report_holds_both_tables_and_a_link_to_every_figure(tmp_path):
    runs = {"fp8 s1": _run(0), "fp8 s2": _run(1)}
    text = report.write_report(runs, tmp_path, "t").read_text()
    assert summary_table(runs) in text and claims_table(runs) in text
    for name in report.FIGURES:
        assert f"]({name})" in text and (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


# ---- logger ------------------------------------------------------------------------------------


def test_the_step_line_formats_every_key_and_leaves_out_what_is_not_finite():
    metrics = {key: 1234.5678 + i for i, (key, _, _) in enumerate(LINE_KEYS)}
    line = step_line(4, 10, metrics)
    expected = "step 4/10 " + " ".join(f"{label} {1234.5678 + i:{fmt}}" for i, (_, label, fmt) in enumerate(LINE_KEYS))
    assert line == expected
    metrics["entropy"], metrics["lr"], metrics["step/skipped"] = math.nan, math.inf, 1.0
    line = step_line(4, 0, metrics)
    assert line.startswith("step 4 reward") and " ent " not in line and " lr " not in line
    assert line.endswith("(skipped)")


def test_a_resumed_logger_keeps_the_history_before_its_start_step_only(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    for step in range(6):
        log.log(step, {"entropy": float(step), "reward/mean": math.nan})
    log.close()
    resumed = MetricsLogger(tmp_path, tensorboard=False, progress=False, start_step=4)
    # the surge detector is rebuilt from this history: steps 0..3, NaN as null
    assert resumed.history == [{"step": s, "entropy": float(s), "reward/mean": None} for s in range(4)]
    assert read_jsonl(tmp_path / "metrics.jsonl") == resumed.history
    resumed.log(4, {"entropy": 9.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert resumed.history[-1] == {"step": 4, "entropy": 9.0}


# ---- sample dumps ------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 2, 3, 7])
def test_sample_records_are_the_first_limit_samples_with_their_own_components(tmp_path, limit):
    from megatron_rl.telemetry.samples import sample_records, write_samples

    n = 3
    recs = sample_records([f"p{i}" for i in range(n)], [f"r{i}" for i in range(n)], [0.1, 0.2, 0.3], [1.0, -1.0, 0.5],
                          [5, 6, 7], ["stop", "length", "stop"], ["a0", "a1", "a2"],
                          {"format": [1.0, 0.0, 1.0], "acc": [0.0, 0.5, 1.0]}, limit)
    assert len(recs) == min(limit, n)
    for i, r in enumerate(recs):
        assert r == {"index": i, "prompt": f"p{i}", "response": f"r{i}", "answer": f"a{i}",
                     "reward": [0.1, 0.2, 0.3][i],
                     "reward/acc": [0.0, 0.5, 1.0][i], "reward/format": [1.0, 0.0, 1.0][i],
                     "advantage": [1.0, -1.0, 0.5][i], "response_length": [5, 6, 7][i],
                     "finish_reason": ["stop", "length", "stop"][i]}
    path = write_samples(tmp_path, 12, recs)
    assert path == tmp_path / "samples" / "step_000012.jsonl" and read_jsonl(path) == recs
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_000012.jsonl"]


# ---- statistics ----------------------------------------------------------------------------------


@FAST
@given(st.integers(1, 9), st.integers(1, 9), st.data())
def test_fisher_exact_matches_scipy(n_a, n_b, data):
    from scipy.stats import fisher_exact as scipy_fisher

    from megatron_rl.telemetry.stats import fisher_exact

    a, b = data.draw(st.integers(0, n_a)), data.draw(st.integers(0, n_b))
    expected = scipy_fisher([[a, n_a - a], [b, n_b - b]], alternative="two-sided").pvalue
    assert fisher_exact(a, n_a, b, n_b) == pytest.approx(expected, rel=1e-9)


def test_the_bootstrap_interval_is_the_quantiles_of_the_resampled_difference():
    from megatron_rl.telemetry.stats import bootstrap_diff_ci

    # a = [0, 1]: the resampled mean is 0, 0.5, 1 with probability 1/4, 1/2, 1/4; b = [0.25] is constant
    diff, low, high = bootstrap_diff_ci([0.0, 1.0], [0.25], resamples=4000, level=0.95, seed=3)
    assert (diff, low, high) == (0.25, -0.25, 0.75)
    # a central 40% interval sits inside the middle atom: both ends 0.5 - 0.25
    assert bootstrap_diff_ci([0.0, 1.0], [0.25], resamples=4000, level=0.4, seed=3) == (0.25, 0.25, 0.25)
    # b's arm is resampled on its own: b = [0, 1] against constant a widens the interval the other way
    assert bootstrap_diff_ci([0.5], [0.0, 1.0], resamples=4000, level=0.95, seed=3) == (0.0, -0.5, 0.5)


def test_the_bootstrap_ends_are_the_binomial_quantiles_of_a_resampled_zero_one_arm():
    from scipy.stats import binom

    from megatron_rl.telemetry.stats import bootstrap_diff_ci

    # a holds 10 zeros and 10 ones: a resample's mean is Binomial(20, 1/2) / 20. The 2.5% and 97.5%
    # quantiles (6 and 14) sit 4 standard errors of 20000 resamples away from the next atom.
    n = 20
    _, low, high = bootstrap_diff_ci([0.0, 1.0] * (n // 2), [0.0], resamples=20_000, level=0.95, seed=1)
    assert (low, high) == (binom.ppf(0.025, n, 0.5) / n, binom.ppf(0.975, n, 0.5) / n) == (0.3, 0.7)


def test_a_resumed_tensorboard_log_holds_each_step_once_with_the_resumed_runs_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, tensorboard=True, progress=False)
    for step in range(6):
        log.log(step, {"entropy": float(step)})
    log.close()
    log = MetricsLogger(tmp_path, tensorboard=True, progress=False, start_step=4)
    for step in (4, 5):
        log.log(step, {"entropy": 10.0 * step, "reward/mean": math.nan})  # NaN: not a TensorBoard point
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("entropy")] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0),
                                                                     (5, 50.0)]
    assert "reward/mean" not in acc.Tags()["scalars"]
