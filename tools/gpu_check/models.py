"""Actors, batches and losses the checks share: random-weight Megatron actors from a run config."""

from __future__ import annotations

_PARALLEL = None
VOCAB = 32000


def parallel():
    """The one 1-rank Megatron setup of this process (nccl on CUDA, gloo on CPU)."""
    global _PARALLEL
    if _PARALLEL is None:
        from megatron_rl.actor.parallel import init_parallel
        from megatron_rl.actor.quiet import megatron_quiet
        with megatron_quiet():
            _PARALLEL = init_parallel(1, 1, seed=0)
    return _PARALLEL


def cfg_of(*overrides: str, te: bool = True):
    """A run config from `section.key=value` overrides; the TE layer spec unless te=False."""
    from megatron_rl.config import load_config
    impl = "transformer_engine" if te else "local"
    keys = list(overrides)
    if not any(k.startswith("parallel.transformer_impl=") for k in keys):
        keys.append(f"parallel.transformer_impl={impl}")
    return load_config(None, keys)


def settings_of(cfg, cuda: bool = True):
    from megatron_rl.actor.settings import resolve_settings
    from megatron_rl.fp8.te_recipe import wgrad_fusion_available
    return resolve_settings(cfg, cuda=cuda, wgrad_fusion=cuda and wgrad_fusion_available())


def spec(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=2816, vocab=VOCAB, arch="llama", head_dim=None,
         tied=False):
    from megatron_rl.models.hf_config import ModelSpec
    return ModelSpec(arch=arch, vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
                     num_attention_heads=heads, num_query_groups=kv_heads, head_dim=head_dim or hidden // heads,
                     norm_eps=1e-6, max_position_embeddings=8192, rope_theta=1000000.0,
                     tie_word_embeddings=tied, qk_norm=arch == "qwen3")


def qwen3_1p7b(layers: int = 28):
    """Qwen3-1.7B's shape (HF config: hidden 2048, 28 layers, 16 / 8 heads of 128, ffn 6144, vocab
    151936, tied embeddings, QK norm), random weights."""
    return spec(hidden=2048, layers=layers, heads=16, kv_heads=8, ffn=6144, vocab=151936, arch="qwen3",
                head_dim=128, tied=True)


def actor_of(cfg, model=None, lr: float = 1e-4):
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.loop.build import build_fp8_recipe
    return MegatronActor.build(model or spec(), parallel=parallel(), fp8_recipe=build_fp8_recipe(cfg), lr=lr,
                               settings=settings_of(cfg))


def batch(rows: int, seq: int, vocab: int = VOCAB, seed: int = 0) -> dict:
    """Random tokens, a loss mask over a response part of varying length, random advantages."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=gen)
    mask = torch.zeros(rows, seq)
    for r, n in enumerate(lengths.tolist()):
        mask[r, seq // 8:n] = 1.0
    return {"tokens": torch.randint(0, vocab, (rows, seq), generator=gen), "loss_mask": mask,
            "advantages": torch.randn(rows, seq, generator=gen)}


def loss_fn(denominator: float):
    """A policy-gradient-shaped loss: -sum(logprob * advantage * mask) / denominator."""
    import torch

    def fn(logprobs, entropy, mb):
        total = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
        return total / denominator, {"pg": torch.stack([total.detach().double(), mb["loss_mask"].sum().double()])}
    return fn


def train(actor, b: dict, steps: int, mbs: int = 2, **kw) -> list[dict]:
    fn = loss_fn(float(b["loss_mask"].sum()))
    return [actor.train_step(b, fn, micro_batch_size=mbs, **kw) for _ in range(steps)]


def masked_max_diff(a, b, mask) -> float:
    """max |a - b| over mask > 0 (tensors [B, S])."""
    on = mask > 0
    return float((a[on] - b[on]).abs().max())


def train_flops_per_token(model, seq: int) -> float:
    """Model FLOPs of one trained token (forward + backward = 3 x forward): 6 x the matmul parameters
    (every linear and the output layer, not the input embedding) + causal attention's QK^T and PV
    (6 x layers x seq x q_dim: 2 matmuls x 2 FLOPs x 3 passes, halved by the causal mask)."""
    from megatron_rl.cluster.memory import layer_params
    linear, _ = layer_params(model)
    matmul = model.num_layers * linear + model.vocab_size * model.hidden_size
    q_dim = model.num_attention_heads * model.head_dim
    return 6.0 * matmul + 6.0 * model.num_layers * seq * q_dim
