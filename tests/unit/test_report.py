"""The comparison report: table reductions by hand, figures written, bad input named."""

import json
import math

import pytest

from megatron_rl.telemetry.report import load_runs, reduce_column, summary_table, write_report


def _records():
    return [{"step": s, "reward/mean": float(s), "entropy": 1.0 + s,
             "shadow/false_clip_low_neg": (0.1 if s % 2 == 0 else None)} for s in range(8)]


def test_reductions_by_hand():
    recs = _records()
    assert reduce_column(recs, "reward/mean", "first") == 0.0
    assert reduce_column(recs, "reward/mean", "last") == pytest.approx((6 + 7) / 2)  # last quarter
    assert reduce_column(recs, "entropy", "max") == 8.0
    assert reduce_column(recs, "shadow/false_clip_low_neg", "all") == pytest.approx(0.1)
    assert math.isnan(reduce_column(recs, "calib/low", "all"))


def test_report_files(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in _records()))
    runs = load_runs([tmp_path / "a", tmp_path / "b"], ["bf16", "fp8"])
    md = write_report(runs, tmp_path / "out", "t")
    text = md.read_text()
    assert "| bf16 |" in text and "| fp8 |" in text
    for png in ("learning.png", "clipping.png", "bounds.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"
    table = summary_table(runs).splitlines()
    assert len(table) == 4  # header, rule, two runs


def test_missing_run_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="absent"):
        load_runs([tmp_path / "absent"])


def test_claims_table_averages_seeds_per_variant():
    from megatron_rl.telemetry.report import claims_table

    runs = {"fp8 s1": [{"step": 0, "shadow/false_clip_low_neg": 0.1}, {"step": 1, "shadow/false_clip_low_neg": 0.3}],
            "fp8 s2": [{"step": 0, "shadow/false_clip_low_neg": 0.6}],
            "bf16 s1": [{"step": 0, "reward/mean": 0.5}]}
    table = claims_table(runs)
    header = table.splitlines()[0]
    assert header.endswith("| fp8 | bf16 |")
    row = next(line for line in table.splitlines() if "false lower-clip rate" in line)
    assert row.split("|")[3].strip() == "0.4"  # mean of seed means (0.2, 0.6)
    assert row.split("|")[4].strip() == ""  # bf16 logs no shadow metrics


def test_held_out_columns_come_from_the_eval_names_the_runs_log():
    from megatron_rl.telemetry.report import eval_columns

    a = [{"step": 0, "reward/mean": 0.1, "eval/aime24/avg@32": 0.2, "eval/aime24/pass@32": 0.5,
          "eval/aime24/bf16/avg@32": 0.9, "eval/math500/pass@4": 0.4, "eval/math500/maj@4": 0.3},
         {"step": 1, "reward/mean": 0.2},
         {"step": 2, "reward/mean": 0.3, "eval/aime24/avg@32": 0.4, "eval/math500/pass@4": 0.6}]
    b = [{"step": 0, "reward/mean": 0.1, "eval/gsm8k/avg@1": 0.7}]
    assert eval_columns({"a": a, "b": b}) == [
        ("aime24 avg@32 first", "eval/aime24/avg@32", "first"), ("aime24 avg@32 last", "eval/aime24/avg@32", "last"),
        ("gsm8k avg@1 first", "eval/gsm8k/avg@1", "first"), ("gsm8k avg@1 last", "eval/gsm8k/avg@1", "last"),
        ("math500 pass@4 first", "eval/math500/pass@4", "first"), ("math500 pass@4 last", "eval/math500/pass@4", "last")]
    lines = summary_table({"a": a, "b": b}).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[1:9] == ["reward first", "reward last", "aime24 avg@32 first", "aime24 avg@32 last", "gsm8k avg@1 first",
                         "gsm8k avg@1 last", "math500 pass@4 first", "math500 pass@4 last"]
    row_a = [c.strip() for c in lines[2].strip("|").split("|")]
    row_b = [c.strip() for c in lines[3].strip("|").split("|")]
    assert row_a[3:9] == ["0.2", "0.4", "", "", "0.4", "0.6"]  # "last" = the last quarter of the evaluations: one
    assert row_b[3:9] == ["", "", "0.7", "0.7", "", ""]
