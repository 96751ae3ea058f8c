"""The real slurm/*.sbatch scripts submitted with sbatch to the two-node test cluster, with the
SGLang server and router doubles (tests/doubles/) in place of SGLang's commands
(rollout.sglang.server_command / router_command): one owner per node's servers, a server killed
mid-rollout, a rank dying, a disaggregated job whose servers stop with the trainer, scancel and a
node going down mid-job. Servers bind to the node names (node1 -> 127.0.0.2, node2 -> 127.0.0.3).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _job import ROOT, TINY, Job, check_against_plan, free_port, tracebacks  # noqa: E402
from sglang_testing import assert_no_generation_while_paused  # noqa: E402

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
    return sorted(str(p.relative_to(job.log_dir)) for p in job.log_dir.glob("node*/*.log"))


def test_colocated_sglang_job_one_owner_per_node_and_a_server_killed_mid_rollout(cluster, tmp_path):
    died = tmp_path / "died"  # the double exits inside the first /generate it serves, once
    record = tmp_path / "record"  # every request the servers got, with their state (paused, version)
    record.mkdir()
    job = Job(cluster, tmp_path, "colocated.sbatch", *_sglang(tmp_path, "--die-on-generate-once", str(died)),
              env={"SGLANG_DOUBLE_RECORD": str(record)})
    assert job.wait() == "COMPLETED" and job.exit_code == "0:0", job.output  # nothing of it left either
    assert job.steps() == [0, 1, 2] and died.exists()
    assert tracebacks(job) == [], job.output  # both nodes' torchrun end cleanly (the exit barrier)
    plan = check_against_plan(job)
    port = plan["hosts"][0]["servers"][0]["port"]
    servers = [{"gpus": [0], "port": port}, {"gpus": [1], "port": port + 1}]
    # hand-worked: DP 4; rank 0 starts and updates node1's two servers, rank 2 node2's
    assert plan == {"layout": "colocated", "world_size": 4, "transport_owners": [0, 2],
                    "hosts": [{"host": "node1", "trainer_ranks": [0, 1], "servers": servers, "router": None},
                              {"host": "node2", "trainer_ranks": [2, 3], "servers": servers, "router": None}]}
    roles = {p["rank"]: (p["role"], p["servers"]) for p in job.placements()}
    # the node's second head starts at its own GPU's server (Placement.servers_for rotates the list)
    assert roles[3] == ("client", [f"http://node2:{port + 1}", f"http://node2:{port}"])
    assert _server_logs(job) == ["node1/sglang_server_0.log", "node1/sglang_server_1.log",
                                 "node2/sglang_server_0.log", "node2/sglang_server_1.log"]
    # the clients (ranks 1 and 3) generate on their node's servers only after the owner resumed them
    assert len(list(record.glob("*.jsonl"))) == 4
    assert_no_generation_while_paused(record, "colocated")


def _disaggregated(tmp: Path, *server_flags: str) -> list[str]:
    return [*_sglang(tmp, *server_flags), "rollout.sglang.mode=disaggregated", "rollout.sglang.weight_transport=nccl",
            f"rollout.sglang.nccl_master_port={free_port()}"]


def test_disaggregated_sglang_job_runs_and_stops_its_servers(cluster, tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    job = Job(cluster, tmp_path, "disaggregated.sbatch", *_disaggregated(tmp_path),
              env={"MEGATRON_RL_ROLLOUT_NODES": "1", "SGLANG_DOUBLE_RECORD": str(record)})
    assert job.wait() == "COMPLETED" and job.exit_code == "0:0", job.output  # servers and router gone too
    assert job.steps() == [0, 1, 2] and tracebacks(job) == []
    plan = check_against_plan(job)
    serving, training = plan["hosts"]
    assert (serving["host"], serving["trainer_ranks"], len(serving["servers"])) == ("node1", [], 2)
    assert serving["router"] is not None and training == {"host": "node2", "trainer_ranks": [0, 1],
                                                          "servers": [], "router": None}
    assert plan["transport_owners"] == [0] and [p["role"] for p in job.placements()] == ["owner", "client"]
    assert len(_server_logs(job)) == 3  # two servers and the router, under the rollout host's folder
    # rank 1 (a client) samples through the router while rank 0 updates the servers: only the
    # barrier that ends every sync keeps its /generate out of the update (no colocated protocol here)
    assert_no_generation_while_paused(record, "disaggregated")


def _running_step(job: Job) -> None:
    job.wait_for(lambda: job.steps() != [] or job.state not in ("PENDING", "RUNNING"), what="step 0")


def test_a_rank_dying_at_step_1_fails_the_job_and_its_owners_stop_their_servers(cluster, tmp_path):
    job = Job(cluster, tmp_path, "colocated.sbatch", *_sglang(tmp_path), "train.num_steps=50")
    _running_step(job)
    victim = next(p["pid"] for p in job.placements() if p["rank"] == 3)
    os.kill(victim, signal.SIGKILL)  # rank 3, a client on the second node, dies during step 1
    assert job.wait() == "FAILED", job.output  # and wait() found no process of the job left
    assert 0 < len(job.steps()) < 50 and "trainer exited with status 0" not in job.output


def test_disaggregated_server_dying_fails_the_job_cleanly(cluster, tmp_path):
    died = tmp_path / "died"
    job = Job(cluster, tmp_path, "disaggregated.sbatch", *_disaggregated(tmp_path, "--die-on-generate-once", str(died)),
              env={"MEGATRON_RL_ROLLOUT_NODES": "1"})
    assert job.wait() == "FAILED", job.output  # and wait() found no process of the job left
    assert died.exists() and "the serve step ended before the trainer" in job.output


def test_scancel_mid_rollout_ends_the_job_with_nothing_left(cluster, tmp_path):
    job = Job(cluster, tmp_path, "colocated.sbatch", *_sglang(tmp_path), "train.num_steps=50")
    _running_step(job)
    subprocess.run(["scancel", job.job_id], env=cluster.env, check=True)
    assert job.wait() == "CANCELLED", job.output  # and wait() found no process of the job left
    assert len(job.steps()) < 50


def test_a_node_set_down_mid_job_ends_it_cleanly(cluster, tmp_path):
    job = Job(cluster, tmp_path, "disaggregated.sbatch", *_disaggregated(tmp_path), "train.num_steps=50",
              env={"MEGATRON_RL_ROLLOUT_NODES": "1"})
    _running_step(job)
    cluster.scontrol("update", "nodename=node2", "state=down", "reason=test")
    # Slurm ends a job that loses a node (NODE_FAIL) and, by default, requeues it; the test
    # cluster's node2 stays down, so the requeued job stays pending: cancel it there.
    job.wait_for(lambda: job.state in ("NODE_FAIL", "PENDING", "REQUEUED") or job.state not in ("RUNNING",
                                                                                             "COMPLETING"),
                 what="the end after node2 went down")
    ended = job.state
    subprocess.run(["scancel", job.job_id], env=cluster.env, check=True)
    final = job.wait()  # and nothing of the job left on either node
    assert ended in ("NODE_FAIL", "PENDING", "REQUEUED") and final in ("CANCELLED", "NODE_FAIL"), (ended, final)
    assert len(job.steps()) < 50
