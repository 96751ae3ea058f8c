"""Slurm environment -> placement plan -> the command lines each host runs; `megatron-rl launch --dry-run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_testing import needs_sglang_source

from megatron_rl.config import load_config
from megatron_rl.cluster.launch import expand_nodelist, serve_argvs, trainer_argv, world_from_env
from megatron_rl.cluster.placement import placement_for_config
from megatron_rl.rollout.sglang_config import SGLangConfig, validate_sglang
from megatron_rl.rollout.sglang_server import server_args

ROOT = Path(__file__).resolve().parents[2]


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a[8-10]b") == ["a8b", "a9b", "a10b"]
    assert expand_nodelist("n001") == ["n001"]
    assert expand_nodelist("r[1-2]-g[1-2]") == ["r1-g1", "r1-g2", "r2-g1", "r2-g2"]


def test_world_from_slurm_variables_and_flags():
    env = {"SLURM_JOB_NODELIST": "h[1-3]", "SLURM_GPUS_ON_NODE": "h100:4", "MEGATRON_RL_ROLLOUT_NODES": "1"}
    assert world_from_env(env) == (["h1", "h2", "h3"], 4, 1)
    assert world_from_env({"MEGATRON_RL_GPUS_PER_NODE": "2"}, nodes=2) == (["node0", "node1"], 2, 0)
    assert world_from_env({}, nodes=3, gpus_per_node=8, rollout_nodes=2) == (["node0", "node1", "node2"], 8, 2)
    with pytest.raises(ValueError, match="--nodes 2"):
        world_from_env(env, nodes=2)


def test_trainer_argv_numbers_ranks_from_the_plan():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                             "rollout.sglang.weight_transport=nccl", "rollout.sglang.tp_size=2"])
    plan = placement_for_config(cfg, ["h1", "h2", "h3", "h4"], 8, rollout_nodes=1)
    argv = trainer_argv(plan, "h3", "cfg.yaml", ["train.lr=1e-6"], master_port=29511)
    assert argv[argv.index("-m") + 1] == "megatron_rl.cluster.torchrun"  # torchrun, ordered exit
    assert {"--nnodes=3", "--node-rank=1", "--nproc-per-node=8", "--master-addr=h2", "--master-port=29511"} <= set(argv)
    assert argv[-3:] == ["megatron_rl.train", "cfg.yaml", "train.lr=1e-6"]


def _dry_run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "launch", "--dry-run", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_dry_run_prints_the_plan_of_a_recipe_under_slurm():
    # qwen3_14b_dapo: colocated, trainer TP 4, SGLang TP 2; 2 nodes x 8 GPUs -> DP 4, owners = local rank 0.
    out = _dry_run("examples/qwen3_14b_dapo/fp8_calibrated.yaml", "rollout.sglang.base_port=31000",
                   env={"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "8"})
    assert out.returncode == 0, out.stderr
    servers = [{"gpus": [2 * i, 2 * i + 1], "port": 31000 + i} for i in range(4)]
    assert json.loads(out.stdout) == {
        "layout": "colocated",
        "hosts": [{"host": "gpu07", "trainer_ranks": list(range(8)), "servers": servers, "router": None},
                  {"host": "gpu08", "trainer_ranks": list(range(8, 16)), "servers": servers, "router": None}],
        "transport_owners": [0, 8], "world_size": 16}


def test_dry_run_refuses_a_bad_layout_naming_it():
    out = _dry_run("examples/qwen25_32b_grpo/fp8_calibrated.yaml", "--nodes", "2", "--gpus-per-node", "8",
                   env={"MEGATRON_RL_ROLLOUT_NODES": "2"})
    assert out.returncode == 2 and "MEGATRON_RL_ROLLOUT_NODES" in out.stderr and out.stdout == ""


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
def test_every_server_flag_is_a_sglang_server_arg():
    import sglang_protocol

    cfg = SGLangConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    flags = [a for a in server_args(cfg, "/m", 30000, 0, seed=1, dist_port=31000) if a.startswith("--")]
    assert "--nccl-port" in flags
    run_cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                                 "rollout.sglang.weight_transport=nccl", "rollout.sglang.tp_size=4"])
    plan = placement_for_config(run_cfg, ["r1", "r2", "t"], 8, rollout_nodes=2)
    argvs = serve_argvs(plan, "r2", run_cfg, "/m", "k")  # not the router host: sglang-router need not be installed
    assert len(argvs) == 2
    assert argvs[1][argvs[1].index("--base-gpu-id") + 1] == "4" and argvs[1][argvs[1].index("--port") + 1] == "30001"
    assert argvs[0][argvs[0].index("--host") + 1] == "r2"
    flags += [a for a in argvs[0] if a.startswith("--")]
    known = sglang_protocol.server_arg_names()
    assert {"--quantization", "--kv-cache-dtype", "--api-key", "--host", "--enable-memory-saver"} <= set(flags)
    assert [f for f in flags if f[2:].replace("-", "_") not in known] == []


def test_serve_step_ends_when_a_server_exits_and_stops_the_others(tmp_path):
    import signal
    import time

    from megatron_rl.cluster.launch import serve

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    survivor = tmp_path / "survivor.pid"
    argvs = [[sys.executable, "-c", f"import os, time; open({str(survivor)!r}, 'w').write(str(os.getpid())); "
                                    "time.sleep(120)", "--port", "1"],
             [sys.executable, "-c", "import time; time.sleep(1.5)", "--port", "2"]]  # dies early
    try:
        start = time.monotonic()
        assert serve(argvs, tmp_path / "logs", "h1") == 1
        assert time.monotonic() - start < 60
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    pid = int(survivor.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert sorted(p.name for p in (tmp_path / "logs" / "h1").iterdir()) == ["server-1.log", "server-2.log"]
