"""JSONL + TensorBoard logging with the same keys; resume truncation; plotting."""

import json

import pytest

from megatron_rl.telemetry.plotting import plot_runs
from megatron_rl.telemetry.logger import MetricsLogger, read_jsonl


def test_jsonl_and_tensorboard_share_keys(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=True, progress=False, total_steps=3)
    for step in range(3):
        log.log(step, {"reward/mean": 0.1 * step, "clip/low_neg": float("nan")})
    log.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["reward/mean"] == 0.2
    assert records[0]["clip/low_neg"] is None  # non-finite values are logged as null, never crash
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == pytest.approx([0.0, 0.1, 0.2], rel=1e-6)


def test_resume_truncates_later_steps(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": s}) + "\n" for s in range(5)))
    log = MetricsLogger(tmp_path, tensorboard=False, progress=False, start_step=3)
    log.log(3, {"reward/mean": 30.0})
    log.close()
    assert [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 30.0]


def test_plot_writes_png(tmp_path):
    runs = {"a": [{"step": s, "reward/mean": s / 10} for s in range(5)], "b": []}
    out = plot_runs(runs, tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moving_average_by_hand():
    from megatron_rl.telemetry.plotting import moving_average

    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0], 5) == [2.0]
