"""A stop request (slurm/job.sh's answer to the job's time-limit warning): the run stops after the
step it is in with a checkpoint of it and names the steps done in MEGATRON_RL_STOP_FILE; a request
during the last step changes nothing. Runs without Slurm (tests/cluster runs the whole requeue)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import run_tiny  # noqa: E402

QUICK = ("train.sft_steps=0", "sync.check=false", "checkpoint.save_every=0")


def test_a_stop_request_stops_after_the_current_step_with_a_checkpoint(tmp_path, monkeypatch):
    request, stopped = tmp_path / "stop-requested", tmp_path / "stopped-at-step"
    request.touch()  # asked before the first step ends: the run stops after step 0
    monkeypatch.setenv("MEGATRON_RL_STOP_REQUEST", str(request))
    monkeypatch.setenv("MEGATRON_RL_STOP_FILE", str(stopped))
    records = run_tiny(tmp_path / "a", "bf16.yaml", "train.num_steps=3", *QUICK)
    assert [r["step"] for r in records] == [0] and stopped.read_text() == "1\n"
    checkpoints = tmp_path / "a" / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000001"]

    stopped.unlink()  # one step left: the request reaches its end, nothing to stop
    records = run_tiny(tmp_path / "a", "bf16.yaml", "train.num_steps=2", "checkpoint.resume=true", *QUICK)
    assert [r["step"] for r in records] == [0, 1] and not stopped.exists()
