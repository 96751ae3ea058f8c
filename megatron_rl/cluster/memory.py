"""Per-GPU memory of the trainer (busiest pipeline stage) and of one rollout server GPU.

Sources of the formulas (docs/plan.md has the derivations):
- weights / gradients / optimizer: Megatron-LM megatron/training/theoretical_memory_usage.py,
  compute_weight_and_optimizer_memory: the most loaded shard holds layers / pp + one embedding
  (+ the output layer when untied and pp == 1), divided by TP; 18 bytes per parameter, or
  6 + 12 / DP with the distributed optimizer (BF16 weight 2, FP32 grad 4, FP32 main weight and two
  Adam moments 12). Parameters are counted exactly per layer from the HF config here.
- activations: the same file, compute_activation_memory (Korthikanti et al. 2022, Table 2):
  s*b*h*(18 + 4*ffn/h) bytes per layer / TP with sequence parallel and selective recompute (flash
  attention never stores the s x s scores, so no recompute is the same), s*b*h*(10 + 24/TP)
  without SP; full recompute keeps each layer's 2*s*b*h input plus one recompute chunk; PP keeps
  min(pp, micro-batches) micro-batches in flight on the first stage. The local spec (no flash
  attention) also stores the s x s scores: 6 bytes each with BF16 parameters (measured on an H200:
  the plan without them was 0.51x the peak of a 0.9B model at 4K tokens; _attention_score_bytes).
- rollout: SGLang 0.5.23 mem_cache/kv_cache_configurator.py:2990-3060 (_profile_available_bytes):
  KV pool = free memory after loading the weights - free memory at start x (1 - mem_fraction_static),
  free memory at start measured by the server process before loading (model_runner.py:1262,
  measure_pre_model_load_memory), so whatever else holds the GPU then (a colocated trainer, built
  before its servers start) shrinks the pool; the activation / CUDA graph reserve is
  runtime_context.py pre_capture_activation_reserve_mb (512 MB + 1.5 MB per chunked-prefill token
  + TP*PP/8 GB, at least 10 GB on GPUs over 60 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.actor.packing import pad_multiple
from megatron_rl.actor.settings import ResolvedSettings, resolve_settings
from megatron_rl.config import RunConfig
from megatron_rl.models.hf_config import ModelSpec

GB = 1024**3
CUDA_CONTEXT_GB = 1.0
"""CUDA context, cuBLAS / NCCL workspaces and allocator slack per process (measured ~0.5-1 GB)."""
SGLANG_CHUNKED_PREFILL = 8192
"""SGLang's default --chunked-prefill-size on 80 GB-class GPUs (server_args.py)."""


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    rollout_nodes: int | None = None
    """Disaggregated: nodes serving SGLang (None: half of them)."""


def layer_params(spec: ModelSpec) -> tuple[int, int]:
    """(linear weights, everything else) of one transformer layer, counted as Megatron builds it."""
    h, hd = spec.hidden_size, spec.head_dim
    qkv_out = (spec.num_attention_heads + 2 * spec.num_query_groups) * hd
    linear = h * qkv_out + spec.num_attention_heads * hd * h + 3 * h * spec.ffn_hidden_size
    other = 2 * h + (qkv_out if spec.qkv_bias else 0) + (2 * hd if spec.qk_norm else 0)
    return linear, other


def stage_params(spec: ModelSpec, tp: int, pp: int) -> tuple[float, float]:
    """(all, transformer-linear) parameters on the most loaded TP x PP shard."""
    linear, other = layer_params(spec)
    layers = spec.num_layers / pp
    embedding = spec.vocab_size * spec.hidden_size
    embeddings = embedding * (2 if not spec.tie_word_embeddings and pp == 1 else 1)
    final_norm = spec.hidden_size if pp == 1 else 0
    total = layers * (linear + other) + embeddings + final_norm
    return total / tp, layers * linear / tp


def tokens_per_micro_batch(cfg: RunConfig, sequence_parallel: bool) -> int:
    t = cfg.train
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if t.max_tokens_per_micro_batch == 0:
        return t.micro_batch_size * longest
    multiple = pad_multiple(cfg.precision.train_recipe, cfg.parallel.tensor_model_parallel_size,
                            sequence_parallel)
    return -(-t.max_tokens_per_micro_batch // multiple) * multiple


def _activation_bytes(cfg: RunConfig, spec: ModelSpec, s: ResolvedSettings, tokens: int) -> float:
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    sbh = tokens / par.context_parallel_size * spec.hidden_size
    if s.sequence_parallel:
        per_layer = sbh * (18 + 4 * spec.ffn_hidden_size / spec.hidden_size) / tp
    else:
        per_layer = sbh * (10 + 24 / tp)
    per_layer += _attention_score_bytes(cfg, spec, s, tokens)
    layers = spec.num_layers / pp
    if par.recompute_granularity == "full":
        kept = 2 * sbh / (tp if s.sequence_parallel else 1)
        chunk = min(par.recompute_num_layers, layers)
        stored = layers * kept + chunk * per_layer
    else:
        stored = layers * per_layer
    # 1F1B: the first stage holds pp micro-batches' activations (and their embedding inputs:
    # 8 bytes per token id + the embedding output).
    return (stored + (8 * tokens + sbh) / tp) * pp


def _attention_score_bytes(cfg: RunConfig, spec: ModelSpec, s: ResolvedSettings, tokens: int) -> float:
    """The s x s attention scores one layer stores for backward on the local spec (Megatron's unfused
    DotProductAttention; TE's flash / fused attention stores none). Megatron-Core 0.16.1
    fused_softmax.py forward_torch_softmax (attention_softmax_in_fp32): the FP32 softmax output is
    saved by the softmax, and with BF16 parameters its BF16 cast by the bmm with V
    (dot_product_attention.py: torch.bmm(attention_probs, value)): 4 + 2 bytes per score; FP32
    parameters: 4 (one tensor). attention_dropout is 0, so the dropout is the identity (no mask).
    Selective recompute recomputes the core attention instead of storing it."""
    if s.transformer_impl != "local" or cfg.parallel.recompute_granularity == "selective":
        return 0.0
    par = cfg.parallel
    packed = cfg.train.max_tokens_per_micro_batch > 0
    rows = 1 if packed else cfg.train.micro_batch_size
    seq = tokens / rows  # a packed row: the scores span the whole row (its mask blocks across documents)
    heads = spec.num_attention_heads / par.tensor_model_parallel_size
    return (6 if s.bf16 else 4) * rows * heads * seq * seq / par.context_parallel_size


def _logprob_bytes(cfg: RunConfig, spec: ModelSpec, tokens: int) -> float:
    """BF16 logits [tokens, V/tp] and their gradient, plus the FP32 working set of the log-prob
    kernel: 4 [chunk, V/tp] tensors chunked (actor/logprobs.py), 5 [tokens, V/tp] whole."""
    tp = cfg.parallel.tensor_model_parallel_size
    vocab = spec.vocab_size / tp
    chunk = cfg.train.logprob_chunk_size
    working = 4 * 4 * min(chunk, tokens) * vocab if chunk else 5 * 4 * tokens * vocab
    return 2 * 2 * tokens * vocab + working


def trainer_memory(cfg: RunConfig, spec: ModelSpec, dp: int, cuda: bool = True) -> dict[str, float]:
    """Bytes on the busiest trainer GPU, by part, as the actor resolves `auto` (actor/settings.py)."""
    s = resolve_settings(cfg, cuda)
    par = cfg.parallel
    params, linear = stage_params(spec, par.tensor_model_parallel_size, par.pipeline_model_parallel_size)
    optimizer = params * ((4 if s.bf16 else 0) + 8)  # FP32 master copy (mixed precision) + Adam
    if s.use_distributed_optimizer:
        optimizer /= dp
    tokens = tokens_per_micro_batch(cfg, s.sequence_parallel)
    fp8 = cfg.precision.train_recipe != "bf16" and s.transformer_impl == "transformer_engine"
    return {
        "weights": params * s.bytes_per_param,
        "grads": params * 4,  # FP32 gradient buffer (grad_reduce_in_fp32)
        "optimizer": optimizer,
        "activations": _activation_bytes(cfg, spec, s, tokens),
        "logprob_chunk": _logprob_bytes(cfg, spec, tokens),
        # TE keeps FP8 row- and column-wise copies of every linear weight (+ scales, ignored).
        "fp8_weight_cache": 2.0 * linear if fp8 else 0.0,
        "cuda_context": CUDA_CONTEXT_GB * GB if cuda else 0.0,
        # The frozen reference policy (KL terms): weights only, sharded like the actor; counted in
        # full although the colocated protocol keeps it on the host outside its forward.
        "reference": params * s.bytes_per_param * cfg.algo.needs_reference,
    }


def sglang_kv_bytes(gpu_bytes: float, resident_at_start: float, weights: float, fraction: float) -> float:
    """SGLang's KV pool (see the module docstring): free after load - free at start x (1 - fraction);
    the server's own CUDA context is in place before either is measured. 0 where SGLang refuses to
    start ("Loaded weights leave no GPU memory for the KV cache")."""
    free_at_start = gpu_bytes - resident_at_start - CUDA_CONTEXT_GB * GB
    free_after_load = free_at_start - weights
    return max(free_after_load - free_at_start * (1.0 - fraction), 0.0)


def rollout_memory(cfg: RunConfig, spec: ModelSpec, gpu_mem_gb: float,
                   resident_at_start: float = 0.0) -> dict[str, float]:
    """Bytes on one rollout GPU: SGLang's weights, KV pool, reserve and process context; the
    embedded engine holds its weights and the KV cache of one step's samples.

    resident_at_start: bytes other processes hold on the GPU when the server starts (colocated:
    the trainer's weights, gradients, optimizer state and context)."""
    sg = cfg.rollout.sglang
    tp = sg.tp_size if cfg.rollout.engine == "sglang" else 1
    linear, other = layer_params(spec)
    embedding = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    fp8 = cfg.precision.rollout_quant != "bf16" or sg.quantization == "fp8"
    block = cfg.precision.weight_block_size
    linear_bytes = (1 + 4 / (block[0] * block[1])) if fp8 else 2  # FP8 + FP32 scale per block
    final_norm = spec.hidden_size
    weights = (spec.num_layers * (linear * linear_bytes + other * 2) + (embedding + final_norm) * 2) / tp
    if cfg.rollout.engine == "torch":
        samples = cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt
        longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
        return {"weights": weights, "kv_cache": samples * longest * kv_cell_bytes(cfg, spec),
                "cuda_graphs": 0.0, "cuda_context": 0.0}
    kv = sglang_kv_bytes(gpu_mem_gb * GB, resident_at_start, weights, sg.mem_fraction_static)
    reserve_mb = 512 + max(_chunked_prefill(sg.extra_args), 2048) * 1.5 + tp / 8 * 1024
    if gpu_mem_gb > 60:
        reserve_mb = max(reserve_mb, 10 * 1024)
    return {"weights": weights, "kv_cache": kv, "cuda_graphs": reserve_mb * 1024**2,
            "cuda_context": CUDA_CONTEXT_GB * GB}


def _chunked_prefill(extra_args: list[str]) -> int:
    if "--chunked-prefill-size" in extra_args:
        return int(extra_args[extra_args.index("--chunked-prefill-size") + 1])
    return SGLANG_CHUNKED_PREFILL


def kv_cell_bytes(cfg: RunConfig, spec: ModelSpec) -> int:
    """KV bytes per token (SGLang pool_configurator cell size: kv heads / TP x (k + v) head dims x
    layers x dtype bytes)."""
    sg = cfg.rollout.sglang
    tp = sg.tp_size if cfg.rollout.engine == "sglang" else 1
    dtype_bytes = 1 if sg.kv_cache_dtype.startswith("fp8") else 2
    return max(spec.num_query_groups // tp, 1) * 2 * spec.head_dim * spec.num_layers * dtype_bytes


def kv_tokens(cfg: RunConfig, spec: ModelSpec, kv_bytes: float) -> int:
    """Tokens the KV cache holds."""
    return int(kv_bytes // kv_cell_bytes(cfg, spec))
