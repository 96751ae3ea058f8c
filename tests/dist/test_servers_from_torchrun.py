"""Servers launched from a real torchrun worker (gloo, 2 workers) through the project's own launch
path (build_servers: launch_env, server_args' --nccl-port) start: each is a stand-in that does what
SGLang's scheduler does before it answers /health (tests/doubles/sglang_dist_standin.py: its own
world of one rank on tcp://127.0.0.1:<its dist port>).

Inside a worker torchrun exports TORCHELASTIC_USE_AGENT_STORE=True (torch/distributed/elastic/agent/
server/local_elastic_agent.py), with which torch's tcp:// rendezvous makes rank 0 a store client too
(torch/distributed/rendezvous.py _create_c10d_store): a server that inherits it waits for a store
nobody starts, and its dist port must never be torchrun's MASTER_PORT, where the agent's store listens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from sglang_testing import _free, free_port_block  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_servers_from_torchrun.py"
pytestmark = pytest.mark.timeout(300)


def torchrun(out: Path, master_port: int, base_port: int, servers: int, extra: list[str] | None = None) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for key in [k for k in env if k.startswith("TORCHELASTIC_") or k in ("MASTER_PORT", "MASTER_ADDR", "RANK")]:
        del env[key]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={master_port}", str(WORKER), str(out), str(base_port),
            str(servers), json.dumps(extra or [])]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def master_port_with_room(below: int) -> int:
    """A free port P (torchrun's MASTER_PORT) with P - below .. P - below + 3 and P + 1000 free too."""
    for _ in range(100):
        port = free_port_block(1)
        room = [*range(port - below, port - below + 4), port + 1000]
        if port - below > 1024 and port + 1000 < 65536 and all(_free(p) for p in room):
            return port
    raise RuntimeError("no free port with room below it")


def test_servers_launched_from_a_torchrun_worker_start(tmp_path):
    master = master_port_with_room(0)
    base = free_port_block(4)
    results = torchrun(tmp_path, master, base, servers=2)
    for rank, r in enumerate(results):
        assert r["use_agent_store"] == "True"  # the worker does have torchrun's flag
        assert r["healthy"], r.get("error")
        ports = [int(flag(a, "--port")) for a in r["argv"]]
        dists = [int(flag(a, "--nccl-port")) for a in r["argv"]]
        assert ports == [base + 2 * rank, base + 2 * rank + 1]
        assert dists == [p + 1000 for p in ports]  # one per server, apart from every HTTP port


def test_a_dist_port_that_would_be_master_port_is_moved_past_it(tmp_path):
    """Rank 0's server's dist port would be its HTTP port + 1000 = MASTER_PORT: it moves on by the
    offset again, never onto the port of rank 1's server (HTTP port + 1 + 1000)."""
    master = master_port_with_room(1000)
    base = master - 1000
    results = torchrun(tmp_path, master, base, servers=1)
    assert all(r["healthy"] for r in results), [r.get("error") for r in results]
    assert [int(flag(r["argv"][0], "--nccl-port")) for r in results] == [master + 1000, master + 1]
    assert [int(flag(r["argv"][0], "--port")) for r in results] == [base, base + 1]


def test_a_dist_port_set_to_master_port_by_hand_is_refused_before_any_server_starts(tmp_path):
    master = master_port_with_room(0)
    results = torchrun(tmp_path, master, free_port_block(2), servers=1, extra=["--nccl-port", str(master)])
    for r in results:
        assert not r["healthy"] and "argv" not in r  # refused before a process was spawned
        assert r["error"] == ("ValueError: rollout.sglang.extra_args: --nccl-port is set by the launcher (one "
                              "distinct port per server, never the trainer's rendezvous port); remove it")
