"""The numbers only a GPU gives, each a ratio of two runs in this same process.

train_fp8_vs_bf16     train-step tokens/s of a Qwen3-1.7B-shaped random model (TE spec, BF16 params +
                      distributed optimizer, 4 x 4096 tokens a step): blockwise FP8 over BF16, and each
                      one's MFU (model FLOPs, models.train_flops_per_token, over the dense BF16 peak)
shadow_cost           Calibrated Clipping's extra passes on that FP8 model: the shadow's two BF16
                      log-prob passes (phases.py _shadow_old, _shadow_ratio) over the step they join
                      (the FP8 old log-probs + the train step)
rollout_fp8_vs_bf16   the embedded engine's generated tokens/s, rollout_quant fp8_blockwise over bf16
weight_sync_inprocess WeightSync into the embedded engine (InProcessTransport, blockwise FP8 payload,
                      512 MiB buckets): seconds per GB
"""

from __future__ import annotations

import gc

from common import Check, timed
from models import actor_of, batch, cfg_of, qwen3_1p7b, train_flops_per_token

SEQ, MICRO_BATCHES, CHUNK = 4096, 4, 1024
# Dense BF16 tensor-core peaks from NVIDIA's datasheets (FLOP/s); MFU is against these for FP8 too.
PEAK_BF16 = {"H100 80GB HBM3": 989.4e12, "H100": 989.4e12, "H200": 989.4e12, "H100 PCIe": 756.5e12}
_FP8_ACTOR = {}


def _peak(name: str):
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in name:
            return PEAK_BF16[key]
    return None


def _train_cfg(recipe: str):
    return cfg_of("precision.params_dtype=bf16", "parallel.use_distributed_optimizer=true",
                  f"precision.train_recipe={recipe}", "parallel.recompute_granularity=none")


def _step_time(actor, b) -> float:
    from models import loss_fn
    fn = loss_fn(float(b["loss_mask"].sum()))
    return timed(lambda: actor.train_step(b, fn, micro_batch_size=1, logprob_chunk_size=CHUNK), repeats=3)


def _collect() -> None:
    """After the caller dropped its last reference to an actor: give its memory back."""
    import torch
    gc.collect()
    torch.cuda.empty_cache()


def train_fp8_vs_bf16(ctx):
    import torch
    model = qwen3_1p7b()
    cfgs = {r: _train_cfg(r) for r in ("bf16", "blockwise")}
    flops = train_flops_per_token(model, SEQ)
    b = batch(MICRO_BATCHES, SEQ, vocab=model.vocab_size)
    ctx.need_cuda()
    tokens = MICRO_BATCHES * SEQ
    seconds = {}
    for recipe, cfg in cfgs.items():
        actor = actor_of(cfg, model, lr=1e-6)
        seconds[recipe] = _step_time(actor, b)
        if recipe == "blockwise":
            _FP8_ACTOR.update(actor=actor, batch=b, step_s=seconds[recipe])
        del actor
        _collect()
    peak = _peak(torch.cuda.get_device_name())
    tps = {r: tokens / s for r, s in seconds.items()}
    mfu = {r: (t * flops / peak if peak else None) for r, t in tps.items()}
    return {"params_b": round(sum(p.numel() for p in _FP8_ACTOR["actor"]._params.values()) / 1e9, 3),
            "tokens_per_step": tokens, "step_s": {r: round(s, 4) for r, s in seconds.items()},
            "tokens_per_s": {r: round(t) for r, t in tps.items()}, "mfu": mfu,
            "ratios": {"train_fp8_over_bf16_tokens_per_s": tps["blockwise"] / tps["bf16"],
                       "train_mfu_bf16": mfu["bf16"], "train_mfu_fp8": mfu["blockwise"]}}


def shadow_cost(ctx):
    cfg = _train_cfg("blockwise")
    ctx.need_cuda()
    if not _FP8_ACTOR:
        model = qwen3_1p7b()
        b = batch(MICRO_BATCHES, SEQ, vocab=model.vocab_size)
        actor = actor_of(cfg, model, lr=1e-6)
        _FP8_ACTOR.update(actor=actor, batch=b, step_s=_step_time(actor, b))
    actor, b, step_s = _FP8_ACTOR.pop("actor"), _FP8_ACTOR.pop("batch"), _FP8_ACTOR.pop("step_s")
    kw = {"micro_batch_size": 1, "with_entropy": False, "logprob_chunk_size": CHUNK}
    old = timed(lambda: actor.compute_logprobs(b, **kw), repeats=3)
    shadow = timed(lambda: actor.compute_logprobs(b, fp8=False, **kw), repeats=3)
    del actor
    _collect()
    return {"old_logprobs_s": round(old, 4), "shadow_pass_s": round(shadow, 4), "train_step_s": round(step_s, 4),
            "ratios": {"calib_shadow_extra_per_step": 2 * shadow / (old + step_s)}}


def _hf_model(device: str):
    """A Qwen3-shaped HF model of ~0.4B parameters, random, built on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.tiny import tiny_hf_config
    config = tiny_hf_config("qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                            num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    if device == "meta":
        return config, None
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return config, model


def rollout_fp8_vs_bf16(ctx):
    import torch

    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.torch_engine import TorchRolloutEngine
    config, _ = _hf_model("meta")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=0)
    prompts = [[(7 * i + 13 * j) % (config.vocab_size - 100) + 100 for j in range(64)] for i in range(64)]
    ctx.need_cuda()
    _, model = _hf_model("cuda")
    rates = {}
    for quant in ("bf16", "fp8_blockwise"):
        engine = TorchRolloutEngine(model, rollout_quant=quant, device="cuda", dtype=torch.bfloat16)
        engine.generate(prompts[:4], SamplingParams(max_new_tokens=8, ignore_eos=True, seed=0))
        torch.cuda.synchronize()
        samples = []
        seconds = timed(lambda: samples.__setitem__(slice(None), engine.generate(prompts, sampling)), repeats=1,
                        warmup=0)
        rates[quant] = sum(len(s.response_ids) for s in samples) / seconds
        engine.shutdown()
        del engine
        gc.collect()
    return {"prompts": len(prompts), "max_new_tokens": sampling.max_new_tokens,
            "tokens_per_s": {q: round(r) for q, r in rates.items()},
            "ratios": {"rollout_fp8_over_bf16_tokens_per_s": rates["fp8_blockwise"] / rates["bf16"]}}


def weight_sync_inprocess(ctx):
    import torch

    from megatron_rl.fp8.rollout_quant import RolloutQuantSpec
    from megatron_rl.models.hf_config import ModelSpec
    from megatron_rl.sync.transport import InProcessTransport
    from megatron_rl.sync.weight_sync import WeightSync
    config, _ = _hf_model("meta")
    model_spec = ModelSpec.from_hf_config(config)
    quant = RolloutQuantSpec("fp8_blockwise")
    cfg = cfg_of("precision.params_dtype=bf16")
    ctx.need_cuda()
    from megatron_rl.rollout.torch_engine import TorchRolloutEngine
    _, model = _hf_model("cuda")
    engine = TorchRolloutEngine(model, rollout_quant="fp8_blockwise", device="cuda", dtype=torch.bfloat16)
    del model
    actor = actor_of(cfg, model_spec)
    sync = WeightSync(actor, InProcessTransport(engine), quant, bucket_mb=512)
    sync.sync()  # warm: the first sync allocates the engine's staging
    torch.cuda.synchronize()
    metrics = [sync.sync() for _ in range(2)]
    best = min(metrics, key=lambda m: m["sync/seconds"])
    s_per_gb = best["sync/seconds"] / (best["sync/bytes"] / 1e9)
    return {"gb": round(best["sync/bytes"] / 1e9, 3), "buckets": best["sync/num_buckets"],
            "seconds": round(best["sync/seconds"], 4), "s_per_gb": round(s_per_gb, 4),
            "ratios": {"weight_sync_inprocess_s_per_gb": s_per_gb}}


CHECKS = [Check("train_fp8_vs_bf16", train_fp8_vs_bf16, 120), Check("shadow_cost", shadow_cost, 60),
          Check("rollout_fp8_vs_bf16", rollout_fp8_vs_bf16, 90),
          Check("weight_sync_inprocess", weight_sync_inprocess, 60)]
