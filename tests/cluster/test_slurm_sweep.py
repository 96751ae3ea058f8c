"""slurm/sweep.sbatch: a two-task job array over seeds on the test cluster, one node per task (both
run at once), one run folder each."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _job import Job, tracebacks  # noqa: E402


def test_a_two_task_array_runs_one_folder_per_seed(cluster, tmp_path):
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("# name overrides\nseed1 train.seed=1\n\nseed2 train.seed=2\n")
    runs = tmp_path / "runs"
    array = Job(cluster, tmp_path, "sweep.sbatch", nodes=1, sbatch=("--array=0-1",), before_config=(str(sweep),),
                env={"MEGATRON_RL_RUNS_DIR": str(runs)})
    tasks = [Job.__new__(Job) for _ in range(2)]
    for i, task in enumerate(tasks):
        task.__dict__.update(array.__dict__, job_id=f"{array.job_id}_{i}")
    assert [t.wait() for t in tasks] == ["COMPLETED", "COMPLETED"], array.output  # nothing of either left
    assert {t.info()["NodeList"] for t in tasks} == {"node1", "node2"}
    for name, seed in (("seed1", 1), ("seed2", 2)):
        task = tasks[seed - 1]
        task.run_dir = runs / name
        assert task.steps() == [0, 1, 2] and tracebacks(task) == []
        assert yaml.safe_load((runs / name / "config.yaml").read_text())["train"]["seed"] == seed
    assert tasks[0].metrics()[0]["entropy"] != tasks[1].metrics()[0]["entropy"]  # two seeds, two runs
