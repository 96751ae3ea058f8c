"""Run the real slurm/*.sbatch scripts on one machine (helper of the tests here): a fake Slurm
(fake_slurm/ on PATH), two "nodes" on 127.0.0.2 and 127.0.0.3, two "GPUs" per node as CPU gloo
ranks, the tiny model.

Each job is checked against its own dry-run plan (logs/<job>/plan.json): every trainer rank reports
its placement at build time (loop/build.py's "placement" log line) and must sit where the plan puts it.
After every job no process of it may be left; what only the fake slurmstepd's end-of-step cleanup
stopped is listed in reaped.txt, which must stay empty when the job ends normally.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_SLURM = Path(__file__).parent / "fake_slurm"
HOSTS = ["127.0.0.2", "127.0.0.3"]
TINY = ["model.tiny_hidden_size=32", "model.tiny_ffn_hidden_size=64", "train.sft_steps=0",
        "data.prompts_per_step=4", "data.num_examples=32", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4", "train.micro_batch_size=8", "train.num_mini_batches=1",
        "log.progress=false", "log.tensorboard=false", "log.plot=false", "checkpoint.save_final=false",
        "checkpoint.save_every=0", "reward.name=position_match", "train.num_steps=3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One `sbatch`-equivalent run of a real script: the variables sbatch and slurmctld would set."""

    def __init__(self, tmp: Path, script: str, *overrides: str, env: dict[str, str] | None = None):
        self.tag = f"sim-{os.getpid()}-{time.monotonic_ns()}"
        self.job_id = str(time.monotonic_ns() % 10**6)
        self.log_root, self.run_dir = tmp / "logs", tmp / "run"
        env = dict(os.environ, PATH=f"{FAKE_SLURM}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                   SLURM_JOB_ID=self.job_id, SLURM_JOB_NAME="sim", SLURM_JOB_NODELIST=",".join(HOSTS),
                   SLURM_JOB_NUM_NODES=str(len(HOSTS)), SLURM_SUBMIT_DIR=str(ROOT), SLURM_CPUS_PER_TASK="1",
                   SLURM_GPUS_ON_NODE="2", MEGATRON_RL_LOG_ROOT=str(self.log_root), PYTHONPATH=str(ROOT),
                   MEGATRON_RL_MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   MEGATRON_RL_SIM_JOB=self.tag, FAKE_SLURM_REAPED=str(tmp / "reaped.txt"), **(env or {}))
        self.reaped_file = tmp / "reaped.txt"
        cmd = ["bash", f"slurm/{script}", str(ROOT / "examples/tiny/bf16.yaml"), *TINY,
               f"log.dir={self.run_dir}", *overrides]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    @property
    def log_dir(self) -> Path:
        return self.log_root / f"sim-{self.job_id}"

    def wait(self, timeout: float = 240.0) -> int:
        try:
            self.output = self.proc.communicate(timeout=timeout)[0].decode()
        finally:
            left = self.leftovers()
            for pid in left:
                os.kill(pid, signal.SIGKILL)
        assert left == [], f"processes of the job still alive after it ended: {left}"
        return self.proc.returncode

    def reaped(self) -> str:
        """What the fake slurmstepd had to kill, without torch's shared-memory daemon
        (torch_shm_manager, used by CPU tensor payloads): it exits by itself once its last client
        has, which can be a moment after the step ended."""
        text = self.reaped_file.read_text() if self.reaped_file.exists() else ""
        return "".join(line for line in text.splitlines(keepends=True) if "torch_shm_manager" not in line)

    def leftovers(self) -> list[int]:
        """Our processes that carry this job's marker in their environment."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and f"MEGATRON_RL_SIM_JOB={self.tag}".encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
        return pids

    def placements(self) -> list[dict]:
        """(node of the srun task, the rank's own report) for every trainer rank."""
        out = []
        for host in HOSTS:
            log = self.log_dir / f"train-{host}.log"
            text = log.read_text() if log.exists() else ""
            out += [dict(json.loads(m), node=host) for m in re.findall(r"placement (\{.*\})", text)]
        return sorted(out, key=lambda p: p["rank"])

    def steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def check_against_plan(job: Job) -> dict:
    plan = json.loads((job.log_dir / "plan.json").read_text())
    seen = job.placements()
    assert [p["rank"] for p in seen] == list(range(plan["world_size"])), job.output
    hosts = {h["host"]: h for h in plan["hosts"]}
    for p in seen:
        assert p["host"] == p["node"] and p["rank"] in hosts[p["node"]]["trainer_ranks"]
        assert p["local_rank"] == hosts[p["node"]]["trainer_ranks"].index(p["rank"])
        assert (p["role"] == "owner") == (p["rank"] in plan["transport_owners"])
    return plan
