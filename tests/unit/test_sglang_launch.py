"""What a launched SGLang server gets from the project: an environment without torchrun's, a
torch.distributed port of its own, and a random seed of its own over the whole job (colocated and
disaggregated alike). The real torchrun case is tests/dist/test_servers_from_torchrun.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_rl.cluster.launch import serve_argvs
from megatron_rl.cluster.placement import placement_for_config
from megatron_rl.config import load_config
from megatron_rl.rollout.sglang_config import SGLangConfig
from megatron_rl.rollout.sglang_server import build_servers, dist_ports, launch_env

pytestmark = pytest.mark.timeout(120)

# What torchrun 2.13 exports to a worker (torch/distributed/elastic/agent/server/local_elastic_agent.py
# _start_workers, _set_local_rank_env; elastic/multiprocessing/api.py; launcher/api.py).
TORCHRUN_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/tmp/err.json",
                "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT"}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_launched_server_inherits_nothing_of_torchrun(monkeypatch):
    for key, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", "k")
    env = launch_env()
    assert not set(TORCHRUN_ENV) & set(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "false"
    (server,) = build_servers(SGLangConfig(server_command=["srv"]), "/m", "k")
    assert server.process.env == env


@pytest.mark.parametrize("master, count, expected", [
    (None, 3, [31000, 31001, 31002]),
    ("31001", 3, [31000, 32001, 31002]),  # server 1's would be MASTER_PORT: one offset further
    ("31000", 2, [32000, 31001]),  # never onto server 1's (31001)
])
def test_each_server_gets_its_own_dist_port_never_the_trainers(monkeypatch, master, count, expected):
    if master is None:
        monkeypatch.delenv("MASTER_PORT", raising=False)
    else:
        monkeypatch.setenv("MASTER_PORT", master)
    cfg = SGLangConfig(base_port=30000, num_servers=count, server_command=["srv"])
    argvs = [s.process.argv for s in build_servers(cfg, "/m", "k")]
    assert [int(flag(a, "--nccl-port")) for a in argvs] == expected
    assert [int(flag(a, "--port")) for a in argvs] == [30000 + i for i in range(count)]
    assert [int(flag(a, "--random-seed")) for a in argvs] == list(range(count))


def test_dist_ports_skip_the_weight_group_and_the_router(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    cfg = SGLangConfig(base_port=28650, num_servers=2, nccl_master_port=29650, router_port=29651 + 64,
                       mode="disaggregated", weight_transport="nccl")
    # 29650, 29651 are weight-group ports (29650 .. 29713): + 1000 again
    assert dist_ports(cfg, [28650, 28651]) == [30650, 30651]
    assert dist_ports(replace(cfg, weight_transport="disk", disk_dir="/w"), [28650, 28651]) == [29650, 29651]
    cfg = SGLangConfig(base_port=29000, num_servers=1, router_port=30000)
    assert dist_ports(cfg, [29000]) == [31000]


@pytest.mark.parametrize("extra, message", [
    (["--nccl-port", "29500"], "rollout.sglang.extra_args: --nccl-port is set by the launcher"),
    (["--dist-init-addr", "127.0.0.1:29500"], "rollout.sglang.extra_args: --dist-init-addr is set by the launcher"),
])
def test_a_hand_set_dist_port_is_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        build_servers(SGLangConfig(extra_args=extra, server_command=["srv"]), "/m", "k")


def test_a_server_port_on_the_trainers_rendezvous_port_is_refused(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "30001")
    with pytest.raises(ValueError) as err:
        build_servers(SGLangConfig(num_servers=2, server_command=["srv"]), "/m", "k")
    assert str(err.value) == ("rollout.sglang.base_port: server port 30001 is the trainer's rendezvous port "
                              "MASTER_PORT=30001; choose another base_port")


def test_colocated_servers_of_every_host_get_distinct_seeds(qwen2_dir, tmp_path, monkeypatch):
    """Two hosts of 2 GPUs, one server per GPU, each host's owner launching its own: four seeds,
    train.seed + the server's index in the job (what disaggregated servers get too, below)."""
    from megatron_rl.loop import build
    from megatron_rl.rollout import sglang_engine

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", "k")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=colocated", "train.seed=5",
                             "rollout.sglang.weight_transport=disk", f"rollout.sglang.disk_dir={tmp_path}/w",
                             "rollout.sglang.server_command=[srv]", "precision.rollout_quant=bf16",
                             f"log.dir={tmp_path}/run"])
    placement = placement_for_config(cfg, ["a", "b"], 2)

    class Launched:  # the engine's servers as SGLangEngine builds them, not started
        def __init__(self, sg, model_path, *, seed, log_dir):
            self.servers = build_servers(sg, str(model_path), "k", seed, log_dir)

    monkeypatch.setattr(sglang_engine, "SGLangEngine", Launched)
    seeds = {}
    for rank in range(placement.world_size):
        if placement.starts_servers(rank):
            engine, _ = build.build_sglang(cfg, qwen2_dir, placement, rank)
            seeds[placement.host_of(rank).host] = [int(flag(s.process.argv, "--random-seed")) for s in engine.servers]
    assert seeds == {"a": [5, 6], "b": [7, 8]}


def test_disaggregated_servers_of_every_host_get_distinct_seeds():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                             "rollout.sglang.weight_transport=nccl", "rollout.sglang.tp_size=4",
                             "rollout.sglang.server_command=[srv]", "rollout.sglang.router_command=[rt]",
                             "train.seed=7"])
    plan = placement_for_config(cfg, ["r1", "r2", "t"], 8, rollout_nodes=2)
    seeds = [int(flag(a, "--random-seed")) for h in ("r1", "r2") for a in serve_argvs(plan, h, cfg, "/m", "k")
             if a[0] == "srv"]
    assert seeds == [7, 8, 9, 10]
