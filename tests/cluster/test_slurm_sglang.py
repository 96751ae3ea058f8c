"""The real slurm/*.sbatch scripts under a fake Slurm with the SGLang server and router doubles
(tests/doubles/) in place of SGLang's commands (rollout.sglang.server_command / router_command):
one owner per node's servers, a server killed mid-rollout, a rank dying, a disaggregated job whose
servers stop with the trainer. Skipped until the doubles and those config keys are present.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _job import ROOT, TINY, Job, check_against_plan, free_port  # noqa: E402

pytestmark = pytest.mark.skipif(not (ROOT / "tests" / "doubles" / "sglang_server_double.py").exists(),
                                reason="the SGLang server / router doubles (tests/doubles/) are not here yet")

DOUBLES = ROOT / "tests" / "doubles"


def _sglang(tmp: Path, *extra_server_flags: str) -> list[str]:
    """Overrides for a job on the SGLang doubles, from a tiny HF model that exists before the job (the
    disaggregated servers load it while the trainer starts)."""
    from megatron_rl.config import load_config
    from megatron_rl.loop.warmstart import prepare_tiny_model

    model = prepare_tiny_model(load_config(ROOT / "examples/tiny/bf16.yaml", TINY), tmp / "models")
    server = ",".join([sys.executable, str(DOUBLES / "sglang_server_double.py"), *extra_server_flags])
    return [f"model.hf_dir={model}", "rollout.engine=sglang", f"rollout.sglang.server_command=[{server}]",
            f"rollout.sglang.router_command=[{sys.executable},{DOUBLES / 'sglang_router_double.py'}]",
            f"rollout.sglang.base_port={free_port()}", f"rollout.sglang.router_port={free_port()}",
            "rollout.sglang.startup_timeout_s=120", "rollout.sglang.request_timeout_s=120"]


def _server_logs(job: Job) -> list[str]:
    return sorted(str(p.relative_to(job.log_dir)) for p in job.log_dir.glob("127.*/*.log"))


def test_colocated_sglang_job_one_owner_per_node_and_a_server_killed_mid_rollout(tmp_path):
    died = tmp_path / "died"  # the double exits inside the first /generate it serves, once
    job = Job(tmp_path, "colocated.sbatch", *_sglang(tmp_path, "--die-on-generate-once", str(died)))
    assert job.wait() == 0, job.output
    assert job.steps() == [0, 1, 2] and died.exists() and job.reaped() == ""
    plan = check_against_plan(job)
    port = plan["hosts"][0]["servers"][0]["port"]
    servers = [{"gpus": [0], "port": port}, {"gpus": [1], "port": port + 1}]
    # hand-worked: DP 4; rank 0 starts and updates 127.0.0.2's two servers, rank 2 127.0.0.3's
    assert plan == {"layout": "colocated", "world_size": 4, "transport_owners": [0, 2],
                    "hosts": [{"host": "127.0.0.2", "trainer_ranks": [0, 1], "servers": servers, "router": None},
                              {"host": "127.0.0.3", "trainer_ranks": [2, 3], "servers": servers, "router": None}]}
    roles = {p["rank"]: (p["role"], p["servers"]) for p in job.placements()}
    assert roles[3] == ("client", [f"http://127.0.0.3:{port}", f"http://127.0.0.3:{port + 1}"])
    assert _server_logs(job) == ["127.0.0.2/sglang_server_0.log", "127.0.0.2/sglang_server_1.log",
                                 "127.0.0.3/sglang_server_0.log", "127.0.0.3/sglang_server_1.log"]


def test_disaggregated_sglang_job_runs_and_stops_its_servers(tmp_path):
    overrides = [*_sglang(tmp_path), "rollout.sglang.mode=disaggregated", "rollout.sglang.weight_transport=nccl",
                 f"rollout.sglang.nccl_master_port={free_port()}"]
    job = Job(tmp_path, "disaggregated.sbatch", *overrides, env={"MEGATRON_RL_ROLLOUT_NODES": "1"})
    assert job.wait() == 0, job.output
    assert job.steps() == [0, 1, 2] and job.reaped() == ""  # the job stopped servers and router itself
    plan = check_against_plan(job)
    serving, training = plan["hosts"]
    assert (serving["host"], serving["trainer_ranks"], len(serving["servers"])) == ("127.0.0.2", [], 2)
    assert serving["router"] is not None and training == {"host": "127.0.0.3", "trainer_ranks": [0, 1],
                                                          "servers": [], "router": None}
    assert plan["transport_owners"] == [0] and [p["role"] for p in job.placements()] == ["owner", "client"]
    assert len(_server_logs(job)) == 3  # two servers and the router, under the rollout host's folder


def test_a_rank_dying_at_step_1_fails_the_job_and_its_owners_stop_their_servers(tmp_path):
    job = Job(tmp_path, "colocated.sbatch", *_sglang(tmp_path), "train.num_steps=50")
    deadline = time.monotonic() + 200
    while job.steps() == [] and job.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    victim = next(p["pid"] for p in job.placements() if p["rank"] == 3)
    os.kill(victim, signal.SIGKILL)  # rank 3, a client on the second node, dies during step 1
    assert job.wait() != 0, job.output  # and wait() found no process of the job left
    assert 0 < len(job.steps()) < 50 and "trainer exited with status 0" not in job.output
    servers_reaped = [line for line in job.reaped().splitlines() if "sglang_server_double.py --" in line]
    assert servers_reaped == []  # the owners (ranks 0 and 2) stopped their servers on SIGTERM


def test_disaggregated_server_dying_fails_the_job_cleanly(tmp_path):
    died = tmp_path / "died"
    overrides = [*_sglang(tmp_path, "--die-on-generate-once", str(died)), "rollout.sglang.mode=disaggregated",
                 "rollout.sglang.weight_transport=nccl", f"rollout.sglang.nccl_master_port={free_port()}"]
    job = Job(tmp_path, "disaggregated.sbatch", *overrides, env={"MEGATRON_RL_ROLLOUT_NODES": "1"})
    assert job.wait() != 0, job.output  # and wait() found no process of the job left
    assert died.exists() and "the serve step ended before the trainer" in job.output
