"""The planner's rollout side and token counts against what they count: the bytes of the payload the
engine receives, a real HF KV cache's bytes per token, and SGLang 0.5.23's activation / CUDA-graph
reserve (srt/runtime_context.py:1797-1819, pre_capture_activation_reserve_mb: 512 MB + 1.5 MB per
chunked-prefill token, at least 2048 of them, + TP x PP / 8 GB; at least 10 GB on a GPU over
60 GB), by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.cluster.memory import (CUDA_CONTEXT_GB, GB, SGLANG_CHUNKED_PREFILL, kv_cell_bytes, kv_tokens,
                                        rollout_memory, sglang_kv_bytes, tokens_per_micro_batch,
                                        trainer_memory)
from megatron_rl.config import load_config
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout
from megatron_rl.models.hf_config import ModelSpec

MB = 1024**2
SGLANG = ["rollout.engine=sglang"]


def _cfg(*overrides):
    return load_config(None, list(overrides))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("quant", ["fp8_blockwise", "bf16"])
@pytest.mark.parametrize("tp", [1, 2])
def test_server_weights_are_the_bytes_of_the_payload_it_receives(tiny_hf_factory, tie, quant, tp):
    """FP8 linears (1 byte + one FP32 scale per 32 x 32 block), everything else in BF16; a TP rank
    holds 1 / TP of it. A tied model ships one embedding matrix."""
    from safetensors.torch import load_file

    folder = tiny_hf_factory("qwen2", tie_word_embeddings=tie)
    weights = load_file(str(folder / "model.safetensors"))
    payload = quantize_for_rollout(sorted(weights.items()),
                                   RolloutQuantSpec(quant, (32, 32), unquantized_dtype="bfloat16"))
    sent = sum(t.numel() * t.element_size() for _, t in payload)
    cfg = _cfg(*SGLANG, f"precision.rollout_quant={quant}", "precision.weight_block_size=[32,32]",
               f"rollout.sglang.tp_size={tp}")
    assert rollout_memory(cfg, ModelSpec.from_hf_config(folder), 80.0)["weights"] == pytest.approx(sent / tp, rel=1e-12)


def test_sglangs_own_fp8_quantization_counts_as_fp8(tiny_hf_factory):
    folder = tiny_hf_factory("qwen2")
    spec = ModelSpec.from_hf_config(folder)
    bf16 = rollout_memory(_cfg(*SGLANG), spec, 80.0)["weights"]
    online = rollout_memory(_cfg(*SGLANG, "rollout.sglang.quantization=fp8"), spec, 80.0)["weights"]
    offline = rollout_memory(_cfg(*SGLANG, "precision.rollout_quant=fp8_blockwise"), spec, 80.0)["weights"]
    assert online == offline < bf16


def test_kv_bytes_per_token_are_a_real_caches(tiny_hf_factory):
    """The embedded engine's KV cache of a BF16 model, measured: keys and values of every layer."""
    from transformers import AutoModelForCausalLM

    folder = tiny_hf_factory("qwen2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    tokens = 7
    with torch.no_grad():
        cache = model(torch.arange(1, tokens + 1)[None], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    cfg = _cfg()
    assert kv_cell_bytes(cfg, ModelSpec.from_hf_config(folder)) == held / tokens
    # an FP8 KV cache holds one byte per value
    assert kv_cell_bytes(_cfg("rollout.sglang.kv_cache_dtype=fp8_e4m3"), ModelSpec.from_hf_config(folder)) == held / tokens / 2


@pytest.mark.parametrize("engine, tp, kv_heads, per_gpu", [
    ("sglang", 2, 8, 4),   # each TP rank holds its share of the KV heads
    ("sglang", 4, 2, 1),   # fewer KV heads than ranks: each rank keeps one (replicated)
    ("torch", 2, 8, 8),    # the embedded engine is one process: rollout.sglang.tp_size does not apply
])
def test_kv_heads_per_gpu_follow_the_servers_tp(tiny_hf_factory, engine, tp, kv_heads, per_gpu):
    spec = ModelSpec.from_hf_config(tiny_hf_factory("qwen2"))
    spec = type(spec)(**{**spec.__dict__, "num_query_groups": kv_heads})
    cfg = _cfg(f"rollout.engine={engine}", f"rollout.sglang.tp_size={tp}")
    assert kv_cell_bytes(cfg, spec) == per_gpu * 2 * spec.head_dim * spec.num_layers * 2


def test_the_embedded_engine_holds_one_steps_samples_and_no_graphs(tiny_hf_factory):
    spec = ModelSpec.from_hf_config(tiny_hf_factory("qwen2"))
    cfg = _cfg("rollout.engine=torch", "rollout.sglang.tp_size=2", "data.prompts_per_step=6",
               "rollout.n_samples_per_prompt=4", "data.max_prompt_len=30", "rollout.max_new_tokens=50")
    mem = rollout_memory(cfg, spec, 80.0)
    assert mem["kv_cache"] == 6 * 4 * (30 + 50) * kv_cell_bytes(cfg, spec)
    assert mem["cuda_graphs"] == 0.0 and mem["cuda_context"] == 0.0
    assert mem["weights"] == rollout_memory(_cfg(*SGLANG), spec, 80.0)["weights"]  # one process: not / TP


@pytest.mark.parametrize("gpu_gb, tp, extra, reserve_mb", [
    (40.0, 1, [], 512 + SGLANG_CHUNKED_PREFILL * 1.5 + 1 / 8 * 1024),
    (40.0, 8, ["--chunked-prefill-size", "1024"], 512 + 2048 * 1.5 + 8 / 8 * 1024),  # at least 2048 tokens
    (40.0, 2, ["--mem-fraction-static", "0.7", "--chunked-prefill-size", "4096"], 512 + 4096 * 1.5 + 2 / 8 * 1024),
    (60.0, 1, ["--chunked-prefill-size", "2048"], 512 + 2048 * 1.5 + 1 / 8 * 1024),  # 60 GB is not over 60
    (61.0, 1, ["--chunked-prefill-size", "2048"], 10 * 1024),
    (80.0, 4, ["--chunked-prefill-size", "16384"], 512 + 16384 * 1.5 + 4 / 8 * 1024),  # over 10 GB anyway
])
def test_the_servers_reserve_is_sglangs(tiny_hf_factory, gpu_gb, tp, extra, reserve_mb):
    spec = ModelSpec.from_hf_config(tiny_hf_factory("qwen2"))
    extra_args = "[" + ",".join(f'"{a}"' for a in extra) + "]"
    cfg = _cfg(*SGLANG, f"rollout.sglang.tp_size={tp}", f"rollout.sglang.extra_args={extra_args}")
    mem = rollout_memory(cfg, spec, gpu_gb)
    assert mem["cuda_graphs"] == reserve_mb * MB and mem["cuda_context"] == CUDA_CONTEXT_GB * GB


def test_the_kv_pool_is_what_is_left_and_never_negative():
    fraction = 0.8
    free_at_start = 80 * GB - 30 * GB - CUDA_CONTEXT_GB * GB
    assert sglang_kv_bytes(80 * GB, 30 * GB, 10 * GB, fraction) == (free_at_start - 10 * GB) - free_at_start * (1 - fraction)
    assert sglang_kv_bytes(80 * GB, 30 * GB, 45 * GB, fraction) == 0.0  # SGLang refuses to start


def test_a_servers_pool_shrinks_by_what_is_resident_when_it_starts(tiny_hf_factory):
    spec = ModelSpec.from_hf_config(tiny_hf_factory("qwen2"))
    cfg = _cfg(*SGLANG)
    alone, beside = rollout_memory(cfg, spec, 80.0), rollout_memory(cfg, spec, 80.0, resident_at_start=8 * GB)
    fraction = cfg.rollout.sglang.mem_fraction_static
    assert alone["kv_cache"] - beside["kv_cache"] == pytest.approx(8 * GB * fraction, rel=1e-9)


def test_kv_tokens_are_whole_cells():
    spec_cfg = _cfg()

    class Spec:  # 2 KV heads x (k + v) x 16 channels x 2 layers x 2 bytes = 256 bytes a token
        num_query_groups, head_dim, num_layers = 2, 16, 2

    assert kv_cell_bytes(spec_cfg, Spec) == 256
    assert kv_tokens(spec_cfg, Spec, 256 * 10 + 255) == 10 and isinstance(kv_tokens(spec_cfg, Spec, 2560.0), int)


@pytest.mark.parametrize("overrides, sequence_parallel, tokens", [
    (["train.micro_batch_size=3", "data.max_prompt_len=100", "rollout.max_new_tokens=28",
      "train.max_tokens_per_micro_batch=0"], False, 3 * 128),
    (["data.max_prompt_len=100", "rollout.max_new_tokens=28", "train.max_tokens_per_micro_batch=1000",
      "precision.train_recipe=blockwise"], False, 1024),                    # packed: up to a multiple of 128
    (["data.max_prompt_len=100", "rollout.max_new_tokens=28", "train.max_tokens_per_micro_batch=1000",
      "precision.train_recipe=blockwise", "parallel.tensor_model_parallel_size=2"], True, 1024),  # 256 x SP
    (["data.max_prompt_len=100", "rollout.max_new_tokens=28", "train.max_tokens_per_micro_batch=1000",
      "precision.train_recipe=blockwise", "parallel.tensor_model_parallel_size=4"], True, 1024),  # 512: 1024
    (["data.max_prompt_len=100", "rollout.max_new_tokens=28", "train.max_tokens_per_micro_batch=1000",
      "precision.train_recipe=blockwise", "parallel.tensor_model_parallel_size=8"], True, 1024),  # 1024
    (["data.max_prompt_len=100", "rollout.max_new_tokens=28", "train.max_tokens_per_micro_batch=1030",
      "precision.train_recipe=mxfp8", "parallel.tensor_model_parallel_size=2"], False, 1056),  # 32, no SP
    (["data.max_prompt_len=100", "rollout.max_new_tokens=28", "train.max_tokens_per_micro_batch=129",
      "precision.train_recipe=bf16"], False, 144),                          # 16
])
def test_tokens_per_micro_batch(overrides, sequence_parallel, tokens):
    assert tokens_per_micro_batch(_cfg(*overrides), sequence_parallel) == tokens


QWEN3_8B = Path(__file__).parents[1] / "data" / "hf_configs" / "qwen3_8b.json"
T = 4096  # tokens per micro-batch below: max_tokens_per_micro_batch=4096 (a multiple of 128 x TP)
PACKED = ["train.max_tokens_per_micro_batch=4096", "data.max_prompt_len=1024", "rollout.max_new_tokens=3072",
          "precision.train_recipe=blockwise", "parallel.tensor_model_parallel_size=2"]


def _activations(*overrides, cuda=True):
    spec = ModelSpec.from_hf_config(QWEN3_8B)
    return trainer_memory(_cfg(*PACKED, *overrides), spec, dp=4, cuda=cuda)["activations"], spec


@pytest.mark.parametrize("overrides, per_token_per_h", [
    # Korthikanti et al. 2022, Table 2 (Megatron-LM theoretical_memory_usage.py), h = 4096,
    # ffn = 12288, 36 layers, TP 2; flash attention (TE) stores no scores. Per token, in units of h
    # bytes: each stored layer, then the first stage's token ids (8 bytes) and embedding output.
    (["parallel.sequence_parallel=false"], 36 * (10 + 24 / 2) + (8 / 4096 + 1) / 2),
    (["parallel.sequence_parallel=true"], 36 * (18 + 4 * 3) / 2 + (8 / 4096 + 1) / 2),
    # full recompute: every layer keeps its input (2 bytes, / TP with SP) + one chunk of layers whole
    (["parallel.sequence_parallel=true", "parallel.recompute_granularity=full", "parallel.recompute_num_layers=1"],
     36 * 2 / 2 + 1 * (18 + 4 * 3) / 2 + (8 / 4096 + 1) / 2),
    (["parallel.sequence_parallel=false", "parallel.recompute_granularity=full", "parallel.recompute_num_layers=4"],
     36 * 2 + 4 * (10 + 24 / 2) + (8 / 4096 + 1) / 2),
    # a chunk larger than the stage (PP 2: 18 layers) recomputes the stage's 18 layers, not 24
    (["parallel.sequence_parallel=true", "parallel.recompute_granularity=full", "parallel.recompute_num_layers=24",
      "parallel.pipeline_model_parallel_size=2"],
     2 * (18 * 2 / 2 + 18 * (18 + 4 * 3) / 2 + (8 / 4096 + 1) / 2)),
    # PP 2: 18 layers a stage, and the first stage holds 2 micro-batches in flight (1F1B)
    (["parallel.sequence_parallel=true", "parallel.pipeline_model_parallel_size=2"],
     2 * (18 * (18 + 4 * 3) / 2 + (8 / 4096 + 1) / 2)),
])
def test_activations_follow_megatrons_formula(overrides, per_token_per_h):
    got, spec = _activations(*overrides)
    assert got == pytest.approx(T * spec.hidden_size * per_token_per_h, rel=1e-12)


def test_the_local_spec_adds_each_layers_attention_scores():
    from megatron_rl.actor.settings import resolve_settings
    from megatron_rl.cluster.memory import _attention_score_bytes

    got, spec = _activations("parallel.sequence_parallel=true", "parallel.transformer_impl=local", cuda=False)
    cfg = _cfg(*PACKED, "parallel.sequence_parallel=true", "parallel.transformer_impl=local")
    scores = _attention_score_bytes(cfg, spec, resolve_settings(cfg, False), T)
    assert scores > 0  # its bytes are checked against real tensors in tests/unit/test_plan.py
    assert got == pytest.approx(36 * (T * spec.hidden_size * (18 + 4 * 3) / 2 + scores)
                                + T * spec.hidden_size * (8 / 4096 + 1) / 2, rel=1e-12)


@pytest.mark.parametrize("chunk, working_rows", [(1024, 4 * 1024), (8192, 4 * T), (0, 5 * T)])
def test_the_log_prob_working_set(chunk, working_rows):
    """BF16 logits and their gradient ([T, V / TP], 2 bytes each), plus the kernel's FP32 working set:
    4 chunk-row tensors (a chunk longer than the micro-batch is the micro-batch), 5 whole ones unchunked."""
    spec = ModelSpec.from_hf_config(QWEN3_8B)
    cfg = _cfg(*PACKED, f"train.logprob_chunk_size={chunk}")
    vocab = spec.vocab_size / 2
    assert trainer_memory(cfg, spec, dp=4)["logprob_chunk"] == 2 * 2 * T * vocab + 4 * working_rows * vocab


# Qwen3-8B per layer, by hand: q and o 4096 x 4096, k and v 4096 x (8 KV heads x 128), gate / up /
# down 4096 x 12288; published total 8,190,735,360 parameters, vocabulary 151,936, untied.
LINEAR_8B = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288
TOTAL_8B, EMBED_8B = 8_190_735_360, 151_936 * 4096


def test_a_stages_parameters_by_pipeline_stage_and_tying():
    from megatron_rl.cluster.memory import stage_params

    spec = ModelSpec.from_hf_config(QWEN3_8B)
    per_layer = (TOTAL_8B - 2 * EMBED_8B - 4096) / 36  # every layer's weights, norms included
    assert stage_params(spec, 1, 1) == (TOTAL_8B, 36 * LINEAR_8B)
    # PP 2: 18 layers and one embedding matrix (the input's, or the output layer's), no final norm here
    assert stage_params(spec, 2, 2) == ((18 * per_layer + EMBED_8B) / 2, 18 * LINEAR_8B / 2)
    tied = type(spec)(**{**spec.__dict__, "tie_word_embeddings": True})
    assert stage_params(tied, 1, 1)[0] == TOTAL_8B - EMBED_8B
    assert stage_params(tied, 1, 2)[0] == 18 * per_layer + EMBED_8B


@pytest.mark.parametrize("overrides, cuda, cache", [
    (["precision.train_recipe=blockwise"], True, 2 * 36 * LINEAR_8B / 2),  # TE keeps row- and column-wise FP8 copies
    (["precision.train_recipe=bf16"], True, 0.0),
    (["precision.train_recipe=blockwise", "parallel.transformer_impl=local"], False, 0.0),  # emulated: no TE copies
])
def test_fp8_weight_caches_and_the_context(overrides, cuda, cache):
    spec = ModelSpec.from_hf_config(QWEN3_8B)
    mem = trainer_memory(_cfg("parallel.tensor_model_parallel_size=2", *overrides), spec, dp=4, cuda=cuda)
    assert mem["fp8_weight_cache"] == cache
    assert mem["cuda_context"] == (CUDA_CONTEXT_GB * GB if cuda else 0.0)


@pytest.mark.parametrize("kl, reference", [(0.0, 0.0), (0.01, 2 * TOTAL_8B / 2)])
def test_a_reference_policy_costs_the_actors_weights(kl, reference):
    spec = ModelSpec.from_hf_config(QWEN3_8B)
    cfg = _cfg("parallel.tensor_model_parallel_size=2", f"algo.kl_loss_coef={kl}")
    assert trainer_memory(cfg, spec, dp=4)["reference"] == reference  # BF16, sharded like the actor


@pytest.mark.parametrize("overrides, rows, seq, heads", [
    (["train.max_tokens_per_micro_batch=0", "train.micro_batch_size=2"], 2, 1024, 32),  # padded rows of 1024
    (["train.max_tokens_per_micro_batch=2048", "train.micro_batch_size=2"], 1, 2048, 32),  # one packed row
    (["train.max_tokens_per_micro_batch=0", "train.micro_batch_size=2", "parallel.tensor_model_parallel_size=2",
      "parallel.sequence_parallel=false"], 2, 1024, 16),
    (["train.max_tokens_per_micro_batch=0", "train.micro_batch_size=2", "parallel.recompute_granularity=selective"],
     0, 1024, 32),  # the core attention is recomputed: nothing stored
])
def test_the_local_specs_scores_by_layout(overrides, rows, seq, heads):
    from megatron_rl.actor.settings import resolve_settings
    from megatron_rl.cluster.memory import _attention_score_bytes

    spec = ModelSpec.from_hf_config(QWEN3_8B)
    common = ["data.max_prompt_len=256", "rollout.max_new_tokens=768", "precision.train_recipe=bf16",
              "precision.params_dtype=bf16", *overrides]
    cfg = _cfg(*common, "parallel.transformer_impl=local")
    tokens = tokens_per_micro_batch(cfg, resolve_settings(cfg, False).sequence_parallel)
    assert _attention_score_bytes(cfg, spec, resolve_settings(cfg, False), tokens) == 6 * rows * heads * seq * seq
    te = _cfg(*common, "parallel.transformer_impl=transformer_engine")
    assert _attention_score_bytes(te, spec, resolve_settings(te, True), tokens) == 0.0  # flash attention


def test_sequence_parallel_pads_the_packed_micro_batch_to_tp_blocks():
    spec = ModelSpec.from_hf_config(QWEN3_8B)
    cfg = _cfg(*PACKED, "train.max_tokens_per_micro_batch=1152", "parallel.sequence_parallel=true",
               "data.max_prompt_len=128", "rollout.max_new_tokens=1024")
    tokens = 1280  # 1152 rounded up to 128 x TP 2
    vocab = spec.vocab_size / 2
    assert trainer_memory(cfg, spec, dp=4)["logprob_chunk"] == 2 * 2 * tokens * vocab + 4 * 4 * 1280 * vocab


def test_non_square_weight_blocks_carry_one_scale_each(tiny_hf_factory):
    from safetensors.torch import load_file

    folder = tiny_hf_factory("qwen2")
    payload = quantize_for_rollout(sorted(load_file(str(folder / "model.safetensors")).items()),
                                   RolloutQuantSpec("fp8_blockwise", (32, 64), unquantized_dtype="bfloat16"))
    sent = sum(t.numel() * t.element_size() for _, t in payload)
    cfg = _cfg(*SGLANG, "precision.rollout_quant=fp8_blockwise", "precision.weight_block_size=[32,64]")
    assert rollout_memory(cfg, ModelSpec.from_hf_config(folder), 80.0)["weights"] == sent
