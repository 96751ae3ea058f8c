"""The tiny RL loop with rollout.engine=sglang against SGLang doubles: two servers behind the router
double, launched by the engine through rollout.sglang.server_command / router_command; colocated
(tensor transport) and disaggregated (NCCL transport, over gloo here), FP8 and BF16, sync.check on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sglang_testing import API_KEY, ROUTER_COMMAND, SERVER_COMMAND, assert_no_generation_while_paused, free_port_block

from test_rl_loop import TINY as LOOP_TINY

from megatron_rl.config import load_config
from megatron_rl.telemetry.logger import read_jsonl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tiny"

# The tiny loop's settings (test_rl_loop.py), made cheaper: 3 steps, short SFT and responses, and
# 32x32 FP8 blocks so the tiny model's q/k/v rows divide as SGLang requires.
TINY = [*LOOP_TINY, "train.sft_steps=10", "rollout.max_new_tokens=6", "train.num_steps=3",
        "precision.weight_block_size=[32,32]"]
MODES = {"colocated": ["rollout.sglang.mode=colocated", "rollout.sglang.weight_transport=tensor"],
         "disaggregated": ["rollout.sglang.mode=disaggregated", "rollout.sglang.weight_transport=nccl"]}
RECIPES = {"fp8": ("fp8_calibrated.yaml", []), "bf16": ("bf16.yaml", [])}


def sglang_overrides(mode: str) -> list[str]:
    base = free_port_block(3)
    return [*MODES[mode], "rollout.engine=sglang", "rollout.sglang.num_servers=2",
            f"rollout.sglang.base_port={base}", "rollout.sglang.launch_router=true",
            f"rollout.sglang.router_port={base + 2}", f"rollout.sglang.nccl_master_port={free_port_block(2)}",
            f"rollout.sglang.server_command=[{','.join(SERVER_COMMAND)}]",
            f"rollout.sglang.router_command=[{','.join(ROUTER_COMMAND)}]",
            "rollout.sglang.startup_timeout_s=120", "rollout.sglang.request_timeout_s=120"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_tiny_loop_against_sglang_doubles(tmp_path_factory, monkeypatch, mode, recipe):
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.train import run

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", API_KEY)
    root = tmp_path_factory.getbasetemp() / "sglang_e2e"  # shares the warm-started tiny model
    log_dir = root / f"{mode}_{recipe}"
    record = tmp_path_factory.mktemp(f"record_{mode}_{recipe}")
    monkeypatch.setenv("SGLANG_DOUBLE_RECORD", str(record))  # every request with the server's state
    config, extra = RECIPES[recipe]
    cfg = load_config(EXAMPLES / config, [*TINY, *extra, *sglang_overrides(mode), f"log.dir={log_dir}"])
    try:
        run(cfg)
    finally:
        destroy_parallel()
    records = read_jsonl(log_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["sync/check_mismatches"] == 0.0 and math.isfinite(r["reward/mean"])
    if recipe == "fp8":
        assert (log_dir / "rollout_fp8" / "config.json").is_file()  # the servers started from block-FP8
    assert_no_generation_while_paused(record, mode)


@pytest.mark.timeout(300)
def test_fp8_kv_cache_syncs_calibrated_scales(tmp_path, monkeypatch):
    """Colocated, FP8 KV cache: the start-up sync carries unit scales, every later one the K/V amax
    the old-log-prob pass recorded (/ 448), and the servers take them with the weights."""
    from megatron_rl.actor import kv_amax
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.train import run

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", API_KEY)
    sent = []
    scales = kv_amax.KvCalibration.scales
    monkeypatch.setattr(kv_amax.KvCalibration, "scales", lambda self: sent.append(scales(self)) or sent[-1])
    cfg = load_config(EXAMPLES / "fp8_calibrated.yaml", [*TINY, *sglang_overrides("colocated"), "train.num_steps=2",
                                                         "rollout.sglang.kv_cache_dtype=fp8_e4m3", f"log.dir={tmp_path}"])
    try:
        run(cfg)
    finally:
        destroy_parallel()
    assert len(sent) == 3 and sent[0] == [(1.0, 1.0)] * len(sent[0])  # start-up sync, then one per step
    for per_layer in sent[1:]:
        assert all(0 < k < 1 and 0 < v < 1 for k, v in per_layer) and len(set(per_layer)) > 1
