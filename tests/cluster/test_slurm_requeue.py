"""Time limits: SIGUSR1 to the batch shell (what `--signal=B:USR1@lead` sends before the limit;
here `scancel --signal=USR1 --batch`) stops the trainer after its current step with a checkpoint;
the job requeues itself and the requeued job resumes. Its metrics equal an uninterrupted run's
bitwise. A job signalled during its last step does not requeue."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _job import Job, tracebacks  # noqa: E402

STEPS = ["train.num_steps=4"]


def _usr1(cluster, job: Job) -> None:
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.job_id], env=cluster.env, check=True)


def _without_time(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]


def test_usr1_stops_at_a_step_boundary_requeues_and_resumes_bitwise(cluster, tmp_path):
    # An uninterrupted run, signalled during its last step: nothing to requeue for.
    whole = Job(cluster, tmp_path, "colocated.sbatch", *STEPS, run_dir=tmp_path / "whole")
    whole.wait_for(lambda: whole.steps() == [0, 1, 2] or whole.state not in ("PENDING", "RUNNING"), what="step 2")
    _usr1(cluster, whole)
    assert whole.wait() == "COMPLETED", whole.output
    assert whole.info()["Restarts"] == "0" and "requeueing" not in whole.output
    assert whole.steps() == [0, 1, 2, 3] and tracebacks(whole) == []

    # The same run, signalled during step 1: stops after it, requeues, resumes from its checkpoint.
    cut = Job(cluster, tmp_path, "colocated.sbatch", *STEPS, run_dir=tmp_path / "cut")
    cut.wait_for(lambda: cut.steps() == [0] or cut.state not in ("PENDING", "RUNNING"), what="step 0")
    _usr1(cluster, cut)
    cut.wait_for(lambda: cut.info()["Restarts"] == "1", what="the requeue")
    assert cut.wait() == "COMPLETED", cut.output  # and nothing of either run left
    stopped = int((cut.log_dir / "stopped-at-step").read_text()) if (cut.log_dir / "stopped-at-step").exists() else None
    assert stopped is None  # the requeued run removed it; the first run's step is in its output
    assert "of the run before its end: requeueing the job" in cut.output
    assert sorted((tmp_path / "cut" / "checkpoints").glob("step_*")) != []
    assert cut.steps() == [0, 1, 2, 3]
    assert _without_time(cut.metrics()) == _without_time(whole.metrics())
