"""The project's Transformer Engine path through Megatron-Core (TE layer spec, ~0.2B random model).

wgrad_fusion      gradient_accumulation_fusion follows apex's import; the TE actor trains either way
te_<recipe>       delayed, tensorwise (current) and blockwise: 3 train steps with finite losses, FP8
                  log-probs within 1 nat of the BF16 shadow's (random init)
packed_thd        packed THD rows give the padded rows' log-probs (1e-2)
recompute_full    full recompute gives no-recompute's loss and grad norm (1e-3 relative)
bf16_distopt      BF16 params + distributed optimizer: FP32 main params, loss decreases
chunked_logprobs  logprob_chunk_size=128 equals the whole-vocab pass (1e-4)
loop_passes       old log-probs, the shadow's two BF16 passes and the train step as the loop runs
                  them (blockwise, chunked): the train forward at the old weights reproduces the
                  old log-probs (ratio 1 within 1e-2), the shadow within 1 nat
"""

from __future__ import annotations

import math

from common import Check, Skip
from models import actor_of, batch, cfg_of, masked_max_diff, settings_of, spec, train

RECIPES = ("delayed", "tensorwise", "blockwise")


def _te_cfg(ctx, *overrides):
    """The TE-spec config and its resolved settings; on CUDA, TE must import (no silent local spec)."""
    from megatron_rl.fp8.te_recipe import megatron_fp8_kwargs, require_te
    from megatron_rl.loop.build import build_fp8_recipe
    cfg = cfg_of(*overrides)
    recipe = build_fp8_recipe(cfg)
    kwargs = megatron_fp8_kwargs(recipe)  # the TransformerConfig fields: pure, runs in the dry mode too
    s = settings_of(cfg, cuda=True)  # resolved as on the GPU (pure): the dry mode checks the combination
    ctx.need_cuda()
    require_te(recipe)
    return cfg, s, kwargs


def wgrad_fusion(ctx):
    from megatron_rl.fp8.te_recipe import wgrad_fusion_available
    cfg, s, _ = _te_cfg(ctx)
    actor = actor_of(cfg, spec(layers=2))
    fused = actor.config.gradient_accumulation_fusion
    out = train(actor, batch(2, 256), 1)
    return {"apex": wgrad_fusion_available(), "fusion": fused, "loss": out[0]["loss"],
            "ok": fused == s.gradient_accumulation_fusion == wgrad_fusion_available()
            and math.isfinite(out[0]["loss"])}


def _not_te_fp8(actor, kwargs) -> dict | None:
    """A FAIL detail when the actor did not get the TE spec with Megatron's FP8 fields."""
    if actor.use_te and actor.config.fp8 == kwargs["fp8"]:
        return None
    return {"use_te": actor.use_te, "fp8": actor.config.fp8, "ok": False}


def te_recipe(recipe):
    def run(ctx):
        cfg, _, kwargs = _te_cfg(ctx, f"precision.train_recipe={recipe}")
        actor = actor_of(cfg)
        wrong = _not_te_fp8(actor, kwargs)
        if wrong:
            return wrong
        b = batch(4, 512)
        losses = [o["loss"] for o in train(actor, b, 3)]
        fp8 = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False)["logprobs"]
        bf16 = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False, fp8=False)["logprobs"]
        diff = masked_max_diff(fp8, bf16, b["loss_mask"])
        return {"fp8_recipe": actor.config.fp8_recipe, "loss": [round(x, 4) for x in losses],
                "max_abs_fp8_vs_bf16": round(diff, 4), "fp8_differs": diff > 0,
                "ok": all(math.isfinite(x) for x in losses) and 0 < diff < 1.0}
    return run


def packed_thd(ctx):
    from megatron_rl.actor.packing import pack_batch, unpack
    b = batch(6, 384)
    packed, index = pack_batch(b, budget=1024, multiple=16)
    cfg, _, _ = _te_cfg(ctx)
    actor = actor_of(cfg)
    padded = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False)["logprobs"]
    thd = unpack(actor.compute_logprobs(packed, micro_batch_size=1, with_entropy=False)["logprobs"], index)
    diff = masked_max_diff(thd, padded, b["loss_mask"])
    return {"rows": int(packed["tokens"].shape[0]), "max_abs_diff": round(diff, 5), "ok": diff < 1e-2}


def recompute_full(ctx):
    import torch
    results = {}
    cfgs = {mode: cfg_of(f"parallel.recompute_granularity={mode}", "parallel.recompute_num_layers=1")
            for mode in ("none", "full")}  # both checked at load, in the dry mode too
    for mode in cfgs:
        cfg, _, _ = _te_cfg(ctx, f"parallel.recompute_granularity={mode}", "parallel.recompute_num_layers=1")
        torch.manual_seed(0)
        actor = actor_of(cfg)
        out = train(actor, batch(2, 512), 1)[0]
        results[mode] = (out["loss"], out["grad_norm"])
        del actor
    (l0, g0), (l1, g1) = results["none"], results["full"]
    return {"loss": [l0, l1], "grad_norm": [g0, g1],
            "ok": abs(l0 - l1) <= 1e-3 * abs(l0) + 1e-6 and abs(g0 - g1) <= 1e-3 * g0 + 1e-6}


def bf16_distopt(ctx):
    cfg, s, _ = _te_cfg(ctx, "precision.params_dtype=bf16", "parallel.use_distributed_optimizer=true")
    actor = actor_of(cfg)
    out = train(actor, batch(4, 512), 3)
    params = list(actor._params.values())
    main = {str(p.main_param.dtype) for p in params if getattr(p, "main_param", None) is not None}
    dtypes = {str(p.dtype) for p in params}
    return {"distributed_optimizer": s.use_distributed_optimizer, "params": sorted(dtypes), "main": sorted(main),
            "loss": [round(o["loss"], 4) for o in out],
            "ok": out[-1]["loss"] < out[0]["loss"] and dtypes == {"torch.bfloat16"}}


def chunked_logprobs(ctx):
    cfg, _, _ = _te_cfg(ctx)
    actor = actor_of(cfg)
    b = batch(2, 512)
    whole = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False)["logprobs"]
    chunked = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False, logprob_chunk_size=128)["logprobs"]
    diff = masked_max_diff(chunked, whole, b["loss_mask"])
    return {"max_abs_diff": diff, "ok": diff < 1e-4}


def loop_passes(ctx):
    """The loop's order on one mini-batch (loop/phases.py prepare, _shadow_old, _shadow_ratio,
    update_policy): FP8 old log-probs, BF16 shadow old, BF16 shadow ratio pass, FP8 train step."""
    import torch
    cfg, _, _ = _te_cfg(ctx, "precision.train_recipe=blockwise", "train.logprob_chunk_size=256")
    chunk = cfg.train.logprob_chunk_size
    b = batch(4, 512)
    actor = actor_of(cfg)
    kw = {"micro_batch_size": 2, "with_entropy": False, "logprob_chunk_size": chunk}
    old = actor.compute_logprobs(b, **kw)["logprobs"]
    shadow_old = actor.compute_logprobs(b, fp8=False, **kw)["logprobs"]
    shadow_new = actor.compute_logprobs(b, fp8=False, **kw)["logprobs"]
    seen = []

    def fn(logprobs, entropy, mb):
        seen.append(logprobs.detach().float().cpu())
        total = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
        return total / float(b["loss_mask"].sum()), {}
    out = actor.train_step(b, fn, micro_batch_size=2, logprob_chunk_size=chunk)
    train_lp = torch.cat(seen, dim=0)
    ratio_dev = masked_max_diff(train_lp, old, b["loss_mask"])
    shadow_dev = masked_max_diff(shadow_old, old, b["loss_mask"])
    return {"train_vs_old_max_abs": ratio_dev, "shadow_vs_fp8_max_abs": round(shadow_dev, 4),
            "shadow_repeat_max_abs": masked_max_diff(shadow_new, shadow_old, b["loss_mask"]),
            "loss": out["loss"], "grad_norm": out["grad_norm"],
            "ok": math.isfinite(out["loss"]) and ratio_dev < 1e-2 and shadow_dev < 1.0}


CHECKS = [Check("wgrad_fusion", wgrad_fusion, 40)]
CHECKS += [Check(f"te_{r}", te_recipe(r), 40) for r in RECIPES]
CHECKS += [Check("packed_thd", packed_thd, 30), Check("recompute_full", recompute_full, 40),
           Check("bf16_distopt", bf16_distopt, 30), Check("chunked_logprobs", chunked_logprobs, 30),
           Check("loop_passes", loop_passes, 40)]
