"""The real slurm/*.sbatch scripts submitted with sbatch to the two-node test cluster, embedded
engine (no servers): placement against the dry-run plan, the job's final state, nothing left behind."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _job import Job, check_against_plan, tracebacks  # noqa: E402


def test_a_rank_dying_at_step_1_fails_the_job_and_stops_everything(cluster, tmp_path):
    job = Job(cluster, tmp_path, "colocated.sbatch", "train.num_steps=50")
    job.wait_for(lambda: job.steps() != [] or job.state not in ("PENDING", "RUNNING"), what="step 0")
    victim = next(p["pid"] for p in job.placements() if p["rank"] == 3)
    os.kill(victim, signal.SIGKILL)  # rank 3 (second node) dies during step 1
    assert job.wait() == "FAILED", job.output  # and wait() found no process of the job left
    assert job.exit_code != "0:0" and len(job.steps()) < 50
    assert "trainer exited with status 0" not in job.output
