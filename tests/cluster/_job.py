"""Submit the real slurm/*.sbatch scripts with the real `sbatch` to the test cluster (conftest.py:
two nodes, node1 and node2, two placeholder GPUs each; CPU gloo ranks), the tiny model.

Each job is checked against its own dry-run plan (logs/<job>/plan.json): every trainer rank reports
its placement at build time (loop/build.py's "placement" log line) and must sit where the plan puts
it. Every job carries a marker in its environment (sbatch exports the submitter's environment to
every step), so after it ends no process of it may be left: found by pid in /proc, never by name.
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
HOSTS = ["node1", "node2"]
TINY = ["model.tiny_hidden_size=32", "model.tiny_ffn_hidden_size=64", "train.sft_steps=0",
        "data.prompts_per_step=4", "data.num_examples=32", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4", "train.micro_batch_size=8", "train.num_mini_batches=1",
        "log.progress=false", "log.tensorboard=false", "log.plot=false", "checkpoint.save_final=false",
        "checkpoint.save_every=0", "reward.name=position_match", "train.num_steps=3"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One `sbatch` of a real script on the test cluster."""

    def __init__(self, cluster, tmp: Path, script: str, *overrides: str, sbatch: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, nodes: int = 2, run_dir: Path | None = None,
                 before_config: tuple[str, ...] = ()):
        self.cluster = cluster
        self.tag = f"job-{os.getpid()}-{time.monotonic_ns()}"
        self.log_root, self.run_dir = tmp / "logs", run_dir or tmp / "run"
        env = dict(cluster.env, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(ROOT),
                   MEGATRON_RL_LOG_ROOT=str(self.log_root), MEGATRON_RL_MASTER_PORT=str(free_port()),
                   OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MEGATRON_RL_TEST_JOB=self.tag, **(env or {}))
        cmd = ["sbatch", "--parsable", f"-N{nodes}", "--gpus-per-node=2", "--cpus-per-task=1",
               f"--output={tmp}/%x-%j.out", *sbatch, f"slurm/{script}", *before_config, str(ROOT / "examples/tiny/bf16.yaml"),
               *TINY, f"log.dir={self.run_dir}", *overrides]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        self.job_id = out.stdout.strip().split(";")[0]
        self.tmp = tmp

    def info(self) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, BatchHost...)."""
        text = self.cluster.scontrol("show", "job", "-o", self.job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    @property
    def state(self) -> str:
        return self.info().get("JobState", "")

    @property
    def name(self) -> str:
        return self.info()["JobName"]

    @property
    def log_dir(self) -> Path:
        return self.log_root / f"{self.name}-{self.info()['JobId']}"  # an array task's own id

    @property
    def output(self) -> str:
        path = self.tmp / f"{self.name}-{self.info()['JobId']}.out"
        text = path.read_text() if path.exists() else ""
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log")))
        return text + logs

    def wait_for(self, ok, timeout: float = 240.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.job_id}: no {what} after {timeout:.0f} s "
                                     f"(state {self.state})\n{self.output}")
            time.sleep(0.5)

    def wait(self, timeout: float = 240.0) -> str:
        """Until the job has ended (not completing any more); its final state. Then no process of it
        may be left (a few seconds' grace: Slurm ends a step's processes after the step)."""
        try:
            self.wait_for(lambda: self.state in ENDED, timeout, "end")
        finally:
            deadline = time.monotonic() + 15
            while self.leftovers() and time.monotonic() < deadline:
                time.sleep(0.5)
            left = {pid: _cmdline(pid) for pid in self.leftovers()}
            for pid in left:
                os.kill(pid, signal.SIGKILL)
        assert left == {}, f"processes of job {self.job_id} still alive after it ended: {left}"
        return self.state

    @property
    def exit_code(self) -> str:
        return self.info()["ExitCode"]

    def leftovers(self) -> list[int]:
        """Processes that carry this job's marker in their environment."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and f"MEGATRON_RL_TEST_JOB={self.tag}".encode() in (entry / "environ").read_bytes():
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

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def steps(self) -> list[int]:
        return [m["step"] for m in self.metrics()]


def _cmdline(pid: int) -> str:
    """The command line, parent and step of a process (what a leftover was)."""
    try:
        proc = Path(f"/proc/{pid}")
        env = dict(v.split("=", 1) for v in proc.joinpath("environ").read_bytes().decode().split("\0") if "=" in v)
        ppid = re.search(r"PPid:\s+(\d+)", proc.joinpath("status").read_text()).group(1)
        where = {k: env.get(k) for k in ("SLURM_STEP_ID", "SLURMD_NODENAME", "RANK", "TORCHELASTIC_RESTART_COUNT")}
        return f"ppid {ppid} {where} " + proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except (OSError, AttributeError):
        return "?"


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


def tracebacks(job: Job) -> list[str]:
    """Log files of the job that hold a Python traceback."""
    return [p.name for p in sorted(job.log_dir.glob("*.log")) if "Traceback (most recent call last)" in p.read_text()]
