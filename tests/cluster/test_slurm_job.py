"""The real slurm/*.sbatch scripts under a fake Slurm, with the embedded engine (no servers):
placement against the dry-run plan, a job that ends with the trainer's status, nothing left behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _job import ROOT, Job, check_against_plan  # noqa: E402

HAVE_DOUBLES = (ROOT / "tests" / "doubles" / "sglang_server_double.py").exists()


@pytest.mark.skipif(HAVE_DOUBLES, reason="test_slurm_sglang.py runs the same job with servers (CI time)")
def test_colocated_job_runs_three_steps_and_ends(tmp_path):
    job = Job(tmp_path, "colocated.sbatch")
    assert job.wait() == 0, job.output
    assert job.steps() == [0, 1, 2]
    plan = check_against_plan(job)
    # hand-worked: 2 hosts x 2 ranks, TP 1 -> DP 4; the embedded engine: every replica owns its own
    assert plan == {"layout": "embedded", "world_size": 4, "transport_owners": [0, 1, 2, 3],
                    "hosts": [{"host": "127.0.0.2", "trainer_ranks": [0, 1], "servers": [], "router": None},
                              {"host": "127.0.0.3", "trainer_ranks": [2, 3], "servers": [], "router": None}]}
    assert "trainer exited with status 0" in job.output and job.reaped() == ""


def test_a_rank_dying_at_step_1_fails_the_job_and_stops_everything(tmp_path):
    job = Job(tmp_path, "colocated.sbatch", "train.num_steps=50")
    deadline = time.monotonic() + 200
    while job.steps() == [] and job.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    victim = next(p["pid"] for p in job.placements() if p["rank"] == 3)
    os.kill(victim, signal.SIGKILL)  # rank 3 (second node) dies during step 1
    assert job.wait() != 0, job.output
    assert len(job.steps()) < 50 and "trainer exited with status 0" not in job.output
