"""Time limits: SIGUSR1 to the batch shell (what `--signal=B:USR1@lead` sends before the limit;
here `scancel --signal=USR1 --batch`) stops the trainer after its current step with a checkpoint;
the job requeues itself and the requeued job resumes, its metrics equal to an uninterrupted run's
bitwise. Signalled again during its last step, the resumed run completes and does not requeue.

Each signal is sent while the run starts up (minutes before its first step ends here), so which
step it stops after is known: the first one it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _job import Job, tracebacks  # noqa: E402

STEPS = ["train.num_steps=2"]
WALL_CLOCK = ("time/", "sync/seconds", "sync/gb_per_s")  # the only metrics two equal runs may differ in


def _usr1(cluster, job: Job) -> None:
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.job_id], env=cluster.env, check=True)


def _without_time(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(WALL_CLOCK)} for m in metrics]


def test_usr1_stops_at_a_step_boundary_requeues_and_resumes_bitwise(cluster, tmp_path):
    whole = Job(cluster, tmp_path, "colocated.sbatch", *STEPS, run_dir=tmp_path / "whole")
    assert whole.wait() == "COMPLETED" and whole.steps() == [0, 1], whole.output

    cut = Job(cluster, tmp_path, "colocated.sbatch", *STEPS, run_dir=tmp_path / "cut")
    cut.wait_for(lambda: (cut.log_dir / "plan.json").exists(), what="the plan (the USR1 trap is set)")
    assert cut.steps() == []
    _usr1(cluster, cut)  # stops after step 0 with a checkpoint, requeues
    stop_file = cut.log_dir / "stopped-at-step"
    cut.wait_for(lambda: cut.info()["Restarts"] == "1" and cut.state == "RUNNING" and not stop_file.exists(),
                 what="the requeued run (it removed the first run's stop file after setting its trap)")
    checkpoints = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_000001"]  # the stop's own: save_every=0 and save_final=false here
    assert cut.steps() == [0]
    _usr1(cluster, cut)  # during the resumed run's last step: nothing left to requeue for
    assert cut.wait() == "COMPLETED", cut.output  # and nothing of either run left
    assert cut.info()["Restarts"] == "1" and cut.steps() == [0, 1] and tracebacks(cut) == []
    # --open-mode=append: the first run's lines are still in the job's output, before the restart's
    out = cut.output
    assert out.index("stopped early with 1 steps done and checkpointed: requeueing the job") < out.index(
        "restart 1: resuming from the latest checkpoint"), out
    assert _without_time(cut.metrics()) == _without_time(whole.metrics())
