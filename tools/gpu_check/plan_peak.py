"""The memory planner (cluster/memory.py trainer_memory) against torch.cuda.max_memory_allocated.

One train step of a ~0.9B random model at 4K tokens (micro-batch 1, no recompute, BF16 params);
the plan without the CUDA context (the allocator does not see it) over the measured peak:
plan_peak_te_fp8   TE spec, blockwise FP8 (TE's FP8 weight copies counted)
plan_peak_te_bf16  TE spec, BF16
plan_peak_local    the local spec (unfused attention: its s x s scores counted since the first
                   H200 run measured the plan at 0.51x)
PASS within [0.8, 1.5] x.
"""

from __future__ import annotations

from common import Check
from models import actor_of, batch, cfg_of, spec, train

SEQ = 4096


def _cfg(te: bool, recipe: str):
    return cfg_of("precision.params_dtype=bf16", f"precision.train_recipe={recipe}", "train.micro_batch_size=1",
                  f"data.max_prompt_len={SEQ // 8}", f"rollout.max_new_tokens={SEQ - SEQ // 8}",
                  "parallel.recompute_granularity=none", te=te)


def plan_peak(te: bool, recipe: str, ratio_name: str | None):
    def run(ctx):
        import torch

        from megatron_rl.cluster.memory import trainer_memory
        model = spec(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632)
        cfg = _cfg(te, recipe)
        parts = trainer_memory(cfg, model, dp=1, cuda=True)
        planned = sum(v for k, v in parts.items() if k != "cuda_context")
        ctx.need_cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        actor = actor_of(cfg, model)
        train(actor, batch(1, SEQ), 1, mbs=1, logprob_chunk_size=cfg.train.logprob_chunk_size)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        ratio = planned / measured
        detail = {"planned_gib": round(planned / 2**30, 2), "measured_gib": round(measured / 2**30, 2),
                  "ratio": round(ratio, 3), "parts_gib": {k: round(v / 2**30, 2) for k, v in parts.items()},
                  "ok": 0.8 <= ratio <= 1.5}
        if ratio_name:
            detail["ratios"] = {ratio_name: ratio}
        return detail
    return run


CHECKS = [Check("plan_peak_te_fp8", plan_peak(True, "blockwise", "plan_peak_over_measured_te_fp8"), 45),
          Check("plan_peak_te_bf16", plan_peak(True, "bf16", "plan_peak_over_measured_te_bf16"), 45),
          Check("plan_peak_local", plan_peak(False, "bf16", None), 45)]
