"""build_run on 2 real gloo ranks of one host (DP=2), colocated SGLang server doubles, tensor transport:
what the built runs wire between the ranks, then one weight sync through that wiring.

Rank 0 owns the host's two servers and gathers each bucket from both ranks (GlooGather); rank 1 is
a client that samples through them and sends its copy to the owner (its IPC peer). Both wait for
the owner's update before sampling (wait_for_owners), on the gloo world of the host groups, which
are made with the run's own model-parallel ranks and the job's long-wait timeout. Only rank 0 logs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from doubles.sglang_testing import API_KEY, SERVER_COMMAND, free_port_block  # noqa: E402
from test_rl_loop import EXAMPLES, TINY  # noqa: E402


def _worker(rank: int, world_size: int, log_dir: str, port: int, overrides: list, env: dict) -> dict:
    import torch.distributed as dist

    from megatron_rl import collectives
    from megatron_rl.config import load_config
    from megatron_rl.loop import build

    os.environ.update(env, MEGATRON_RL_SGLANG_API_KEY=API_KEY)
    made, real = [], collectives.make_host_groups
    collectives.make_host_groups = lambda mp, dp, timeout_s: made.append(timeout_s) or real(mp, dp, timeout_s=timeout_s)
    waits, real_barrier = [], collectives.barrier

    def barrier(group):  # named below: the default group, the host groups' gloo world, or another
        waits.append(group)
        real_barrier(group)
    collectives.barrier = barrier
    command = "[" + ",".join(f"'{c}'" for c in SERVER_COMMAND) + "]"
    cfg = load_config(EXAMPLES / "fp8_calibrated.yaml", [
        *TINY, "train.sft_steps=0", "model.tiny_num_layers=1", "precision.weight_block_size=[32,32]",
        "rollout.engine=sglang", "rollout.sglang.mode=colocated", "rollout.sglang.weight_transport=tensor",
        f"rollout.sglang.server_command={command}", f"rollout.sglang.base_port={port}",
        "rollout.sglang.startup_timeout_s=120", "parallel.host_wait_timeout_s=321", "sync.check=true",
        "log.tensorboard=false", "log.progress=false", f"log.dir={log_dir}", *overrides])
    run = build.build_run(cfg)
    try:
        g = run.host_groups
        out = {"wait_for_owners": run.sync.wait_for_owners, "peer": run.sync.peer is not None,
               "gather_src": getattr(getattr(run.sync.transport, "gather", None), "src", None),
               "transport": type(run.sync.transport).__name__, "logging": run.logger.enabled,
               "host_groups": [collectives.group_ranks(x) for x in (g.mp, g.dp, g.world)], "timeouts": made,
               "servers": [s.url for s in run.engine.servers] if run.engine else None}
        built = len(waits)
        metrics = run.sync.sync()  # collective: the client's copy goes to the owner, the owner updates
        collectives.barrier = real_barrier
        names = ["default" if w is None else "world" if w is g.world else "other" for w in waits]
        out.update(waits=names[:built], sync_waits=names[built:])
        # after sync() every rank has waited for the owner's update: both see the new version at once
        servers = run.engine.servers if run.engine else []
        out["versions"] = [s.client.get("/model_info")["weight_version"] for s in servers] if run.engine else None
        out["mismatches"] = metrics.get("sync/check_mismatches")
        dist.barrier()  # the client is done with the servers before the owner stops them
        return out
    finally:
        run.finish()


@pytest.mark.timeout(240)  # 35-55 s on 2 cores; mismatched groups hang until the launcher's limit
def test_a_colocated_host_of_two_ranks_is_wired_owner_to_client_and_syncs_once(tmp_path):
    port = free_port_block(2)
    owner, client = run_distributed(_worker, world_size=2, args=(str(tmp_path / "run"), port, [], {}), timeout_s=200)
    servers = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    assert (owner["transport"], owner["gather_src"], owner["peer"]) == ("SGLangTensorTransport", 0, False)
    assert (client["transport"], client["gather_src"], client["peer"]) == ("NoneType", None, True)
    assert owner["wait_for_owners"] is client["wait_for_owners"] is True  # a client samples after the update
    assert (owner["logging"], client["logging"]) == (True, False)
    assert owner["host_groups"] == [[0], [0, 1], [0, 1]] and client["host_groups"] == [[1], [0, 1], [0, 1]]
    assert owner["timeouts"] == client["timeouts"] == [321.0]
    # the warm-started model on the default group (no host groups yet); the rollout's waits on the gloo world
    assert owner["waits"] == client["waits"] == ["default", "world", "world"]
    # each bucket's gather ends on the host's group; then the client waits for the owner's update
    assert owner["sync_waits"] == client["sync_waits"] and set(owner["sync_waits"][:-1]) == {"other"}
    assert owner["sync_waits"][-1] == "world"
    assert owner["servers"] == servers and client["servers"] == [servers[1], servers[0]]
    assert owner["versions"] == client["versions"] == ["1", "1"]
    assert owner["mismatches"] == 0.0


@pytest.mark.timeout(300)  # about 50 s on 2 cores
def test_two_colocated_hosts_of_tp2_ranks_each_gather_on_their_own_owner(tmp_path):
    """TP=2 x DP=2 on two hosts (127.0.0.1 and 127.0.0.2, two ranks each): rank 2 owns the second
    host's servers and gathers from rank 3 only; ranks 1 and 3 (TP peers, no engine) are IPC peers."""
    port = free_port_block(2)
    env = {"MEGATRON_RL_HOSTS": "127.0.0.1,127.0.0.2", "MEGATRON_RL_GPUS_PER_NODE": "2"}
    r = run_distributed(_worker, world_size=4, args=(str(tmp_path / "run"), port,
                                                      ["parallel.tensor_model_parallel_size=2"], env), timeout_s=240)
    hosts = [[f"http://{h}:{port}", f"http://{h}:{port + 1}"] for h in ("127.0.0.1", "127.0.0.2")]
    for rank, out in enumerate(r):
        owner = rank % 2 == 0
        assert out["host_groups"] == [[2 * (rank // 2), 2 * (rank // 2) + 1], [rank % 2, rank % 2 + 2],
                                      [0, 1, 2, 3]], rank
        assert (out["gather_src"], out["peer"]) == ((rank, False) if owner else (None, True)), rank
        assert out["servers"] == (hosts[rank // 2] if owner else None), rank
        assert out["versions"] == (["1", "1"] if owner else None), rank
        assert out["wait_for_owners"] is False  # every replica head owns its servers: no client waits
        assert out["logging"] is (rank == 0)
        assert out["waits"] == ["default", "world", "world"] and set(out["sync_waits"]) == {"other"}
