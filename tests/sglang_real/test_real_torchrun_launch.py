"""A real server launched from inside a torchrun worker through the project's own path (SGLangEngine ->
build_servers -> launch_env), as a colocated owner rank launches its host's servers.

torchrun's static rendezvous exports TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR and MASTER_PORT to
its workers (the agent hosts a TCPStore there); a server inheriting them runs SGLang's scheduler,
whose `init_process_group(init_method="tcp://127.0.0.1:<dist port>")` (srt/distributed/bootstrap.py)
goes through torch's `_create_c10d_store`. torch 2.14.1 (sglang's pin) makes it a store *client*
only when the dist port is MASTER_ADDR:MASTER_PORT (rendezvous.py `_agent_store_serves`); with
nothing listening there it waits out the timeout (the hang of issue 39, item 1); torch <= 2.13 does
it for every port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import real_sglang
from sglang_testing import free_port_block

from megatron_rl.rollout.sglang_server import DIST_PORT_OFFSET

WORKER = Path(__file__).with_name("_torchrun_worker.py")
START_S = 200  # a healthy start takes 47-100 s here; a scheduler stuck in _create_c10d_store never ends


def _torchrun(model: Path, tmp: Path, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    master, http = free_port_block(1), free_port_block(1)
    if "--collide" in flags:  # the launcher's first dist port for this server is MASTER_PORT
        http = master - DIST_PORT_OFFSET
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(master), str(WORKER), str(model), str(tmp / "out.json"), str(http), *flags]
    env = dict(os.environ, START_S=str(START_S), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(real_sglang.REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=START_S + 120)
    return proc, time.monotonic() - t0


def _server_log(tmp: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in tmp.glob("sglang_server_*.log"))


def test_a_server_launched_from_a_torchrun_worker_starts_and_serves(real_model, tmp_path):
    from test_sglang_real_engine import greedy_from_folder

    proc, _ = _torchrun(real_model, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + _server_log(tmp_path)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["worker_env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the worker really is torchrun's
    assert out["tokens"] == greedy_from_folder(real_model, [1, 5, 6, 7], 4)


def test_a_dist_port_that_would_be_masters_port_is_moved_and_the_server_starts(real_model, tmp_path):
    """The collision of issue 39, item 1: the server's HTTP port is MASTER_PORT - DIST_PORT_OFFSET, so
    the launcher's first choice of SGLang's dist port is torchrun's MASTER_PORT, where the agent's
    store listens. The launcher moves it one offset further; the server, started without torchrun's
    environment, rendezvouses on its own port, starts and serves the checkpoint's greedy tokens."""
    from test_sglang_real_engine import greedy_from_folder

    proc, elapsed = _torchrun(real_model, tmp_path, "--collide")
    assert proc.returncode == 0, proc.stderr[-3000:] + _server_log(tmp_path)
    out = json.loads((tmp_path / "out.json").read_text())
    master = int(out["worker_env"]["MASTER_PORT"])
    assert out["dist_port"] == master + DIST_PORT_OFFSET  # moved off MASTER_PORT, one offset further
    assert out["tokens"] == greedy_from_folder(real_model, [1, 5, 6, 7], 4)
    assert elapsed < START_S, f"the start took {elapsed:.0f} s"
