"""W&B in offline mode (no network) logs the same keys as TensorBoard and metrics.jsonl; the per-step
line; a missing wandb is a config error naming the key."""

import json
import os
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.telemetry.logger import step_line

wandb = pytest.importorskip("wandb") if os.environ.get("CI") != "true" else __import__("wandb")

STEPS = [{"reward/mean": 0.25, "entropy": 1.5, "reward/exact": 0.0, "response_length/clip_ratio": 0.5},
         {"reward/mean": 0.5, "entropy": 1.25, "reward/exact": 1.0, "response_length/clip_ratio": 0.0,
          "calib/high": float("inf")}]


def _history(run_file: Path) -> list[dict]:
    """The history rows of an offline run file, read independently of wandb's writer: a 7-byte
    header, then LevelDB-log records (4-byte crc, 2-byte length, 1-byte type FULL=1 / FIRST=2 /
    MIDDLE=3 / LAST=4, in 32 KiB blocks) holding wandb_internal_pb2.Record protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, part = run_file.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # a block's tail too short for a header is padding
            continue
        length, kind = int.from_bytes(data[pos + 4: pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7: pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            records.append(part)
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


_LOG_TWO_STEPS = """
import json, sys
from megatron_rl.telemetry.logger import MetricsLogger
logger = MetricsLogger(sys.argv[1], tensorboard=True, progress=False, total_steps=2,
                       wandb={"project": "p", "name": "n", "mode": "offline"})
for step, metrics in enumerate(json.loads(sys.argv[2])):
    logger.log(step, metrics)
logger.close()
"""


def test_offline_run_has_the_tensorboard_keys(tmp_path):
    """In a fresh process, as a training run is: W&B keeps process-wide state (its service and the
    current run), which a test process that ran hundreds of other tests does not start from."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", _LOG_TWO_STEPS, str(tmp_path), json.dumps(STEPS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = _history(run_file)
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    logged = {k for row in rows for k in row if not k.startswith("_")}
    assert logged == set(tb.Tags()["scalars"]) == {"reward/mean", "entropy", "reward/exact", "response_length/clip_ratio"}
    assert [(r["_step"], r["reward/mean"], r["reward/exact"]) for r in rows] == [(0, 0.25, 0.0), (1, 0.5, 1.0)]


def test_step_line():
    line = step_line(2, 40, {"reward/mean": 0.41234, "entropy": 0.3, "response_length/mean": 12.25,
                             "response_length/clip_ratio": 0.125, "time/step": 3.04, "calib/high": float("inf")})
    assert line == "step 2/40 reward 0.4123 ent 0.3 len 12.2 trunc 0.125 s 3.0"
    assert step_line(0, 0, {"step/skipped": 1.0}) == "step 0 (skipped)"


def test_missing_wandb_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="config key 'log.wandb.project'"):
        load_config(None, ["log.wandb.project=p"])
    load_config(None, ["log.wandb.project=p", "log.wandb.mode=disabled"])
