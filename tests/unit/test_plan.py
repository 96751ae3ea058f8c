"""`megatron-rl plan`: parameter counts against published totals, planned bytes against the tensors
a real CPU actor allocates, every recipe fits at its stated node counts, oversized configs refused."""

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_rl.cli import main as cli_main
from megatron_rl.config import load_config
from megatron_rl.models.hf_config import ModelSpec
from megatron_rl.cluster.memory import GB, Cluster, stage_params, trainer_memory
from megatron_rl.cluster.plan import check_fits, plan

ROOT = Path(__file__).parents[2]
HF_CONFIGS = ROOT / "tests" / "data" / "hf_configs"
RECIPE_MODELS = {"qwen3_8b_grpo": "qwen3_8b", "qwen3_14b_dapo": "qwen3_14b", "qwen25_32b_grpo": "qwen25_32b"}


def stated_node_counts() -> dict[str, list[int]]:
    """examples/README.md table: `| folder/ | what | 2-4 nodes ... |` -> {folder: [2, 4]}."""
    counts = {}
    for line in (ROOT / "examples" / "README.md").read_text().splitlines():
        match = re.match(r"\| `(\w+)/` \|[^|]*\| (\d+)(?:-(\d+))? nodes", line)
        if match:
            counts[match[1]] = sorted({int(match[2]), int(match[3] or match[2])})
    return counts


def test_parameter_counts_match_published_totals():
    # Qwen2.5-32B: 32,763,876,352 parameters (HF model card / safetensors index, untied).
    spec = ModelSpec.from_hf_config(HF_CONFIGS / "qwen25_32b.json")
    assert stage_params(spec, 1, 1)[0] == 32_763_876_352
    # Qwen3-8B: 8,190,735,360 (safetensors total_size 16,381,470,720 bytes in BF16).
    assert stage_params(ModelSpec.from_hf_config(HF_CONFIGS / "qwen3_8b.json"), 1, 1)[0] == 8_190_735_360


def test_megatron_bytes_per_parameter():
    """Megatron's theoretical_memory_usage: 18 bytes/param, or 6 + 12/DP with the distributed optimizer."""
    spec = ModelSpec.from_hf_config(HF_CONFIGS / "qwen3_8b.json")
    params = stage_params(spec, 2, 1)[0]
    for dist_opt, per_param in ((False, 18), (True, 6 + 12 / 8)):
        cfg = load_config(None, [f"parallel.use_distributed_optimizer={str(dist_opt).lower()}",
                                 "parallel.tensor_model_parallel_size=2"])
        mem = trainer_memory(cfg, spec, dp=8)
        assert mem["weights"] + mem["grads"] + mem["optimizer"] == pytest.approx(params * per_param)


@pytest.mark.parametrize("recipe", sorted(RECIPE_MODELS))
def test_every_recipe_fits_at_its_stated_nodes(recipe, capsys):
    nodes = stated_node_counts()[recipe]
    for config in sorted((ROOT / "examples" / recipe).glob("*.yaml")):
        for n in nodes:
            code = cli_main(["plan", str(config), "--nodes", str(n), "--json",
                             "--hf-config", str(HF_CONFIGS / f"{RECIPE_MODELS[recipe]}.json")])
            result = json.loads(capsys.readouterr().out)
            assert code == 0 and result["fits"], (config.name, n, result)
            assert set(result) >= {"trainer", "rollout", "colocated", "peak_gb_per_gpu", "gpu_mem_gb", "fits"}
            for side in ("trainer", "rollout"):
                parts = {k: v for k, v in result[side].items() if k != "total"}
                assert result[side]["total"] == pytest.approx(sum(parts.values()), abs=0.05)


def test_tiny_recipes_fit(capsys):
    for config in sorted((ROOT / "examples" / "tiny").glob("*.yaml")):
        assert cli_main(["plan", str(config), "--gpus-per-node", "1", "--gpu-mem-gb", "8"]) == 0
        assert "fits" in capsys.readouterr().out


def test_oversized_config_is_refused(capsys):
    """Qwen2.5-32B trained on one node at TP=2 next to its SGLang server, no recompute."""
    config = ROOT / "examples" / "qwen25_32b_grpo" / "bf16.yaml"
    overrides = ["parallel.tensor_model_parallel_size=2", "parallel.recompute_granularity=none",
                 "rollout.sglang.mode=colocated", "rollout.sglang.weight_transport=tensor"]
    code = cli_main(["plan", str(config), *overrides, "--nodes", "1", "--json",
                     "--hf-config", str(HF_CONFIGS / "qwen25_32b.json")])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and not result["fits"] and result["peak_gb_per_gpu"] > 80
    assert cli_main(["plan", str(config), "parallel.nope=1"]) == 2  # bad key: config error


def test_train_start_check_refuses_unless_allowed(tmp_path):
    hf = tmp_path / "m"
    hf.mkdir()
    (hf / "config.json").write_text((HF_CONFIGS / "qwen25_32b.json").read_text())
    over = [f"model.hf_dir={hf}", "parallel.tensor_model_parallel_size=2", "rollout.engine=torch"]
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80)
    with pytest.raises(ValueError, match="allow_oversized"):
        check_fits(load_config(None, over), cluster)
    assert not check_fits(load_config(None, over + ["train.allow_oversized=true"]), cluster)["fits"]
    assert check_fits(load_config(None, over), None) is None  # no GPU: nothing to check


def test_planned_state_bytes_equal_a_real_cpu_actor(qwen2_dir, single_parallel):
    """FP32 weights, FP32 grad buffer and Adam moments of the real actor, byte for byte."""
    from megatron_rl.actor.actor import MegatronActor

    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel)
    batch = {"tokens": torch.randint(0, 128, (2, 8)), "loss_mask": torch.ones(2, 8)}
    actor.train_step(batch, lambda lp, ent, mb: ((lp * mb["loss_mask"]).sum(), {}), micro_batch_size=2)
    params = list(actor.model[0].parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params)
    states = actor.optimizer.optimizer.state.values() if hasattr(actor.optimizer, "optimizer") else []
    optimizer = sum(t.numel() * t.element_size() for s in states for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
    cfg = load_config(None, [f"model.hf_dir={qwen2_dir}"])
    planned = trainer_memory(cfg, ModelSpec.from_hf_config(qwen2_dir), dp=1, cuda=False)
    assert (planned["weights"], planned["grads"], planned["optimizer"]) == (weights, grads, optimizer)


def sglang_kv_pool_gib(total_gib, other_gib, weights_gib, mem_fraction_static, context_gib=1.0):
    """SGLang 0.5.23, transcribed: model_runner.py:1262 measures pre_model_load_memory (free GiB
    once the server's CUDA context exists, whatever else the GPU holds); after loading,
    mem_cache/kv_cache_configurator.py:2999-3038 sets
        slack_gb = pre_model_load_memory * (1 - mem_fraction_static)
        rest_memory = available_gpu_memory - slack_gb   # available: free GiB after the weights
    and :3043-3057 refuses to start when rest_memory <= 0."""
    pre_model_load_memory = total_gib - other_gib - context_gib
    available_gpu_memory = pre_model_load_memory - weights_gib
    slack_gb = pre_model_load_memory * (1 - mem_fraction_static)
    return available_gpu_memory - slack_gb


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_kv_pool_is_sized_as_sglang_sizes_it(mode):
    """Qwen3-8B FP8 at 2 nodes: colocated servers start next to the built trainer (weights, grads,
    optimizer, context resident), so the pool is ~21 GiB, not mem_fraction_static x 80 - weights."""
    overrides = [f"rollout.sglang.mode={mode}"] + (["rollout.sglang.weight_transport=nccl"] if mode != "colocated" else [])
    cfg = load_config(ROOT / "examples" / "qwen3_8b_grpo" / "fp8.yaml", overrides)
    result = plan(cfg, ModelSpec.from_hf_config(HF_CONFIGS / "qwen3_8b.json"), Cluster(nodes=2))
    t, r = result["trainer"], result["rollout"]
    other = t["weights"] + t["grads"] + t["optimizer"] + t["cuda_context"] if mode == "colocated" else 0.0
    expected = sglang_kv_pool_gib(80.0, other, r["weights"], cfg.rollout.sglang.mem_fraction_static)
    assert r["kv_cache"] == pytest.approx(expected, abs=0.02)
    if mode == "colocated":
        assert 18 < r["kv_cache"] < 24  # the old plan said 39.2 GiB (mem_fraction_static x 80 GB - weights)
        # Training keeps the engine's graphs and context; generation the trainer's context and FP8 caches.
        assert result["peak_gb_per_gpu"] == pytest.approx(max(
            t["total"] + r["cuda_graphs"] + r["cuda_context"], r["total"] + t["cuda_context"] + t["fp8_weight_cache"]), abs=0.05)


@pytest.mark.parametrize("params_dtype", ["fp32", "bf16"])
def test_planned_attention_scores_equal_what_the_local_spec_saves(qwen2_dir, single_parallel, params_dtype):
    """The s x s tensors autograd keeps for backward in a real local-spec train step (counted by a
    saved-tensors hook, each storage once) are the plan's attention-score term, byte for byte."""
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.cluster.memory import _attention_score_bytes
    from megatron_rl.actor.settings import resolve_settings

    rows, seq = 2, 24
    dtype = torch.bfloat16 if params_dtype == "bf16" else torch.float32
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, params_dtype=dtype)
    batch = {"tokens": torch.randint(0, 128, (rows, seq)), "loss_mask": torch.ones(rows, seq)}
    seen: dict[int, int] = {}

    def pack(t):
        if t.dim() >= 2 and tuple(t.shape[-2:]) == (seq, seq) and t.numel() > seq * seq:  # the shared causal mask is [1, 1, s, s]
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor.train_step(batch, lambda lp, ent, mb: ((lp * mb["loss_mask"]).sum(), {}), micro_batch_size=rows)
    cfg = load_config(None, [f"model.hf_dir={qwen2_dir}", f"precision.params_dtype={params_dtype}",
                             f"train.micro_batch_size={rows}", "data.max_prompt_len=4", f"rollout.max_new_tokens={seq - 4}"])
    spec = ModelSpec.from_hf_config(qwen2_dir)
    per_layer = _attention_score_bytes(cfg, spec, resolve_settings(cfg, cuda=False), rows * seq)
    assert per_layer == (6 if params_dtype == "bf16" else 4) * rows * spec.num_attention_heads * seq * seq
    assert sum(seen.values()) == per_layer * spec.num_layers
