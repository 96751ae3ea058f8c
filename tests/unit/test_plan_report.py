"""`megatron-rl plan`'s arithmetic and report, by hand: the trainer's data-parallel size in each
layout, each phase's peak from the parts, the table's text, the start-of-training refusal, the
command's arguments. (tests/unit/test_plan.py checks the parts against real tensors and recipes.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megatron_rl.cluster.memory import GB, Cluster, trainer_memory
from megatron_rl.cluster.plan import check_fits, format_table, main, plan, spec_of, trainer_dp
from megatron_rl.config import load_config
from megatron_rl.models.hf_config import ModelSpec

ROOT = Path(__file__).parents[2]
QWEN3_8B = ROOT / "tests" / "data" / "hf_configs" / "qwen3_8b.json"
FP8 = ROOT / "examples" / "qwen3_8b_grpo" / "fp8.yaml"
DISAGG = ["rollout.sglang.mode=disaggregated", "rollout.sglang.weight_transport=nccl"]


def _cfg(*overrides, path=FP8):
    return load_config(path, list(overrides))


@pytest.mark.parametrize("overrides, cluster, dp", [
    (["rollout.engine=torch", "parallel.tensor_model_parallel_size=2"], Cluster(nodes=2), 8),
    # the torch engine shares the trainer's GPUs whatever rollout.sglang.mode says
    (["rollout.engine=torch", *DISAGG, "parallel.tensor_model_parallel_size=2"], Cluster(nodes=2), 8),
    ([*DISAGG, "parallel.tensor_model_parallel_size=2"], Cluster(nodes=5), 12),  # rollout on 5 // 2 nodes
    ([*DISAGG, "parallel.tensor_model_parallel_size=2"], Cluster(nodes=5, rollout_nodes=1), 16),
    (["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"], Cluster(nodes=2), 4),
])
def test_the_trainers_data_parallel_size_by_layout(overrides, cluster, dp):
    got = trainer_dp(_cfg(*overrides), cluster)
    assert got == dp and isinstance(got, int)


def test_context_parallel_counts_in_the_model_parallel_size():
    cfg = _cfg("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2")
    cfg.parallel.context_parallel_size = 2  # the config refuses CP > 1 today; the planner counts it
    assert trainer_dp(cfg, Cluster(nodes=2)) == 2


@pytest.mark.parametrize("overrides, cluster, gpus, mp", [
    (["parallel.tensor_model_parallel_size=8"], Cluster(nodes=1, gpus_per_node=12), 12, 8),  # more GPUs, no multiple
    (["parallel.tensor_model_parallel_size=4"], Cluster(nodes=1, gpus_per_node=2), 2, 4),  # fewer GPUs
    ([*DISAGG, "parallel.tensor_model_parallel_size=8"], Cluster(nodes=2), 8, 8),  # fits: no error
])
def test_a_world_that_tp_x_pp_x_cp_does_not_divide_is_refused(overrides, cluster, gpus, mp):
    cfg = _cfg(*overrides)
    if gpus % mp == 0:
        assert trainer_dp(cfg, cluster) == 1
        return
    with pytest.raises(ValueError) as err:
        trainer_dp(cfg, cluster)
    assert str(err.value) == f"config key 'parallel': {gpus} trainer GPUs are not a multiple of TP x PP x CP = {mp}"


def _by_hand(result):
    t, r = result["trainer"], result["rollout"]
    if not result["colocated"]:
        return {"training": t["total"], "generating": r["total"]}
    resident = t["weights"] + t["grads"] + t["optimizer"] + t["cuda_context"]
    return {"training": t["total"] + r["cuda_graphs"] + r["cuda_context"],
            "generating": r["total"] + t["cuda_context"] + t["fp8_weight_cache"],
            "saving": resident + r["weights"] + r["cuda_graphs"] + r["cuda_context"]}


@pytest.mark.parametrize("overrides", [[], DISAGG, ["rollout.engine=torch"]])
def test_each_phase_peak_is_the_sum_of_what_that_phase_holds(overrides):
    cfg = _cfg(*overrides)
    result = plan(cfg, ModelSpec.from_hf_config(QWEN3_8B), Cluster(nodes=2))
    t = result["trainer"]
    assert t["fp8_weight_cache"] > 1 and t["cuda_context"] > 0.5  # terms large enough to be seen
    expected = _by_hand(result)
    assert result["phases"] == pytest.approx(expected, abs=0.03)
    peak_phase = max(result["phases"], key=result["phases"].get)
    assert result["peak_phase"] == peak_phase and result["peak_gb_per_gpu"] == result["phases"][peak_phase]
    assert result["sequence_tokens"] == cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    gb = [v for side in ("trainer", "rollout", "phases") for v in result[side].values()] + [result["peak_gb_per_gpu"]]
    assert all(v == round(v, 2) for v in gb)  # GB with two decimals


def test_a_save_between_steps_can_set_the_peak():
    """Colocated with a short sequence: the trainer's activations are small, so the save (trainer
    state back beside the engine's weights) is the largest phase."""
    cfg = _cfg("data.max_prompt_len=64", "rollout.max_new_tokens=64", "train.max_tokens_per_micro_batch=256")
    result = plan(cfg, ModelSpec.from_hf_config(QWEN3_8B), Cluster(nodes=2))
    assert result["peak_phase"] == "saving"
    assert result["peak_gb_per_gpu"] == pytest.approx(_by_hand(result)["saving"], abs=0.03)


def test_without_cuda_the_trainer_has_no_context():
    cfg, spec = _cfg("parallel.transformer_impl=auto"), ModelSpec.from_hf_config(QWEN3_8B)
    dp = trainer_dp(cfg, Cluster(nodes=2))
    on_cpu = plan(cfg, spec, Cluster(nodes=2), cuda=False)["trainer"]
    assert on_cpu["cuda_context"] == 0.0
    assert on_cpu["weights"] == round(trainer_memory(cfg, spec, dp, cuda=False)["weights"] / GB, 2)


RESULT = {"trainer": {"weights": 1.5, "total": 2.0}, "rollout": {"kv_cache": 3.25, "total": 4.0},
          "colocated": True, "phases": {"training": 2.5, "generating": 5.0, "saving": 1.0},
          "peak_phase": "generating", "peak_gb_per_gpu": 5.0, "gpu_mem_gb": 80.0,
          "kv_cache_tokens": 1234, "sequence_tokens": 99, "fits": True}


def test_the_table_says_every_part_the_phases_and_the_verdict():
    assert format_table(RESULT).splitlines() == [
        "part                        GB/GPU",
        "trainer.weights               1.50",
        "trainer.total                 2.00",
        "rollout.kv_cache              3.25",
        "rollout.total                 4.00",
        "layout: colocated (one GPU, release/offload protocol); GB/GPU by phase: training 2.50, generating 5.00, "
        "saving 1.00",
        "KV cache holds 1234 tokens; the longest sequence needs 99",
        "peak 5.00 GB of 80 GB per GPU (generating): fits"]
    apart = dict(RESULT, colocated=False, fits=False, phases={"training": 2.0, "generating": 4.0})
    assert format_table(apart).splitlines()[-3:] == [
        "layout: disaggregated; GB/GPU by phase: training 2.00, generating 4.00",
        "KV cache holds 1234 tokens; the longest sequence needs 99",
        "peak 5.00 GB of 80 GB per GPU (generating): DOES NOT FIT"]


def test_the_start_check_says_how_to_go_on_and_shows_the_table(tmp_path):
    hf = tmp_path / "m"
    hf.mkdir()
    (hf / "config.json").write_text(QWEN3_8B.read_text())
    cfg = _cfg(f"model.hf_dir={hf}", "rollout.engine=torch", "parallel.recompute_granularity=none")
    cluster = Cluster(nodes=1, gpus_per_node=2, gpu_mem_gb=24)
    with pytest.raises(ValueError) as err:
        check_fits(cfg, cluster)
    table = format_table(plan(cfg, spec_of(cfg), cluster))
    assert str(err.value) == ("the memory plan says this config does not fit (set train.allow_oversized=true "
                              "to start anyway):\n" + table)


def test_the_model_comes_from_its_config_or_the_tiny_model(tmp_path):
    with pytest.raises(ValueError) as err:
        spec_of(_cfg(f"model.hf_dir={tmp_path}"))
    assert str(err.value) == (f"config key 'model.hf_dir': no config.json in {tmp_path} "
                              "(pass --hf-config PATH to plan without the checkpoint)")
    tiny = load_config(ROOT / "examples" / "tiny" / "fp8_calibrated.yaml", ["model.tiny_hidden_size=96"])
    spec = spec_of(tiny)
    m = tiny.model
    assert (spec.hidden_size, spec.num_layers, spec.num_attention_heads, spec.num_query_groups,
            spec.ffn_hidden_size) == (96, m.tiny_num_layers, m.tiny_num_heads, m.tiny_num_kv_heads,
                                      m.tiny_ffn_hidden_size)
    from megatron_rl.data.char_tokenizer import build_char_tokenizer
    assert spec.vocab_size == len(build_char_tokenizer())


def _args(**kw):
    base = dict(config=str(FP8), overrides=DISAGG, nodes=5, gpus_per_node=8, gpu_mem_gb=80.0,
                rollout_nodes=None, hf_config=str(QWEN3_8B), json=True)
    return argparse.Namespace(**{**base, **kw})


def test_the_command_plans_the_cluster_it_is_given(capsys):
    assert main(_args()) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(_args(rollout_nodes=1)) == 0  # 4 trainer nodes instead of 3: a larger DP shards the optimizer more
    one = json.loads(capsys.readouterr().out)
    assert one["trainer"]["optimizer"] < default["trainer"]["optimizer"]
    assert main(_args(json=False, gpu_mem_gb=20.0)) == 1
    out = capsys.readouterr().out
    assert out.startswith("part") and out.rstrip().endswith("DOES NOT FIT") and "of 20 GB per GPU" in out


def test_a_plan_that_exactly_fills_the_gpu_fits():
    """Disaggregated, so the trainer GPUs' peak is the trainer's total: a GPU of exactly that many
    bytes fits (GB is a power of two: the division is exact), one byte less does not."""
    spec = ModelSpec.from_hf_config(QWEN3_8B)
    cfg = _cfg(*DISAGG)
    cluster = Cluster(nodes=4)
    total = sum(trainer_memory(cfg, spec, trainer_dp(cfg, cluster)).values())
    exact = Cluster(nodes=4, gpu_mem_gb=total / GB)
    first = plan(cfg, spec, exact)
    assert first["peak_phase"] == "training" and first["fits"]
    assert not plan(cfg, spec, Cluster(nodes=4, gpu_mem_gb=(total - 1) / GB))["fits"]


def test_the_jobs_cluster_is_its_world_and_its_devices_memory(monkeypatch):
    import torch

    from megatron_rl.cluster.plan import job_cluster

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert job_cluster() is None  # no device: nothing to plan
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    asked = []

    def properties(device):
        asked.append(device)
        return type("Props", (), {"total_memory": 80 * GB + GB // 2})()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert job_cluster() == Cluster(nodes=2, gpus_per_node=8, gpu_mem_gb=80.5, rollout_nodes=0) and asked == [3]
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert job_cluster() == Cluster(nodes=1, gpus_per_node=1, gpu_mem_gb=80.5, rollout_nodes=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a partial node still plans one node
    assert job_cluster().nodes == 1
