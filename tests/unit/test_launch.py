"""Slurm environment -> plan of trainer ranks and rollout servers; command lines SGLang accepts."""

from __future__ import annotations

import pytest

from sglang_testing import needs_sglang_source

from megatron_rl.launch import expand_nodelist, make_plan, plan_from_env, rollout_argvs, trainer_argv
from megatron_rl.rollout.sglang_config import SGLangConfig, validate_sglang
from megatron_rl.rollout.sglang_server import server_args


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a[8-10]b") == ["a8b", "a9b", "a10b"]
    assert expand_nodelist("n001") == ["n001"]
    assert expand_nodelist("r[1-2]-g[1-2]") == ["r1-g1", "r1-g2", "r2-g1", "r2-g2"]


def test_disaggregated_plan_splits_nodes_and_numbers_servers():
    plan = plan_from_env({"SLURM_JOB_NODELIST": "h[1-4]", "MEGATRON_RL_LAYOUT": "disaggregated",
                          "MEGATRON_RL_ROLLOUT_NODES": "1", "MEGATRON_RL_SGLANG_TP": "2", "SLURM_GPUS_ON_NODE": "8"})
    assert plan.rollout_nodes == ["h1"] and plan.trainer_nodes == ["h2", "h3", "h4"]
    assert plan.servers_of("h1") == [f"http://h1:{30000 + i}" for i in range(4)]
    assert plan.master_addr == "h2" and plan.router_url == "http://h1:30999"
    argv = trainer_argv(plan, "h3", "cfg.yaml", ["train.lr=1e-6"])
    assert argv[argv.index("-m") + 1] == "torch.distributed.run"
    assert {"--nnodes=3", "--node-rank=1", "--nproc-per-node=8", "--master-addr=h2"} <= set(argv)
    assert "rollout.sglang.server_urls=[http://h1:30000,http://h1:30001,http://h1:30002,http://h1:30003]" in argv
    assert argv[-1] == "train.lr=1e-6"


def test_colocated_plan_puts_servers_on_every_trainer_node():
    plan = make_plan(["a", "b"], "colocated", gpus_per_node=8, tp_size=4)
    assert plan.trainer_nodes == plan.rollout_nodes == ["a", "b"]
    assert plan.servers_of("b") == ["http://b:30000", "http://b:30001"]
    argv = trainer_argv(plan, "b", "c.yaml", [])
    assert "--node-rank=1" in argv and "rollout.sglang.host=b" in argv and "rollout.sglang.num_servers=2" in argv


@pytest.mark.parametrize("kw, key", [
    (dict(layout="mixed"), "MEGATRON_RL_LAYOUT"),
    (dict(tp_size=3), "MEGATRON_RL_SGLANG_TP"),
    (dict(layout="disaggregated", rollout_nodes=2), "MEGATRON_RL_ROLLOUT_NODES"),
])
def test_bad_launch_settings_name_the_variable(kw, key):
    args = dict(nodes=["a", "b"], layout="colocated", gpus_per_node=8, tp_size=1) | kw
    with pytest.raises(ValueError, match=key):
        make_plan(**args)


@pytest.mark.parametrize("kw, key", [
    (dict(host="0.0.0.0"), "host"), (dict(mode="colocated", weight_transport="nccl"), "weight_transport"),
    (dict(mode="disaggregated", weight_transport="tensor"), "weight_transport"),
    (dict(weight_transport="disk"), "disk_dir"), (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    (dict(mem_fraction_static=1.5), "mem_fraction_static"),
])
def test_bad_sglang_settings_name_the_key(kw, key):
    with pytest.raises(ValueError, match=f"rollout.sglang.{key}"):
        validate_sglang(SGLangConfig(**kw))


def test_missing_api_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("MEGATRON_RL_SGLANG_API_KEY", raising=False)
    with pytest.raises(ValueError, match="MEGATRON_RL_SGLANG_API_KEY"):
        SGLangConfig().api_key()


@needs_sglang_source
def test_every_server_flag_is_a_sglang_server_arg(monkeypatch):
    import sglang_protocol

    cfg = SGLangConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    flags = [a for a in server_args(cfg, "/m", 30000, 0, seed=1) if a.startswith("--")]
    plan = make_plan(["r1", "r2", "t"], "disaggregated", 8, 8, rollout_nodes=2)
    argvs = rollout_argvs(plan, "r2", "/m", "k")  # not the router node: sglang-router need not be installed
    assert len(argvs) == 1
    flags += [a for a in argvs[0] if a.startswith("--")]
    known = sglang_protocol.server_arg_names()
    assert {"--quantization", "--kv-cache-dtype", "--api-key", "--host", "--enable-memory-saver"} <= set(flags)
    assert [f for f in flags if f[2:].replace("-", "_") not in known] == []
