"""Two torchrun agents (nodes 0 and 1 of a static rendezvous, one worker each) on loopback: a
successful run must end without "Error waiting on exit barrier" on either. Node 1's agent is
delayed between its barrier arrival and its wait (as a loaded or descheduled node is), which makes
plain torchrun's node 0 close its store under node 1 every time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKER = "import os, time; time.sleep(0.5 if os.environ['GROUP_RANK'] == '1' else 0.0)\n"
# Fault injection in node 1's agent only: torch/distributed/elastic/utils/store.py's barrier calls
# _barrier_nonblocking (add, and set by the last member), then store.wait; 1 s passes in between.
DELAYED_AGENT = """\
import runpy, sys, time
import torch.distributed.elastic.utils.store as store_util
arrive = store_util._barrier_nonblocking
store_util._barrier_nonblocking = lambda *a, **k: (arrive(*a, **k), time.sleep(1.0))[0]
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp: Path, module: str) -> list[tuple[int, str]]:
    (tmp / "worker.py").write_text(WORKER)
    (tmp / "delayed_agent.py").write_text(DELAYED_AGENT)
    port = _port()
    args = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", module, *args, "--node-rank=0", str(tmp / "worker.py")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
             subprocess.Popen([sys.executable, str(tmp / "delayed_agent.py"), module, *args, "--node-rank=1",
                               str(tmp / "worker.py")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    return [(p.wait(timeout=120), p.stdout.read()) for p in procs]


def test_a_successful_two_node_run_ends_without_an_exit_barrier_error(tmp_path):
    for rc, out in _two_nodes(tmp_path, "megatron_rl.cluster.torchrun"):
        assert rc == 0 and "exit barrier" not in out and "Traceback" not in out, out


def test_plain_torchrun_shows_the_race_this_guards_against(tmp_path):
    """The injection reproduces the failure seen on a real two-node Slurm job (guards the test)."""
    _, (_, node1) = _two_nodes(tmp_path, "torch.distributed.run")
    assert "Error waiting on exit barrier" in node1 and "Failed to recv" in node1, node1
