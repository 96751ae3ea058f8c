"""The actor on a GPU (skipped without CUDA): BF16 parameters with the distributed optimizer and
both overlaps, on the local spec (explicit opt-out of TE), against the FP32 actor."""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _batch():
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 64)
    mask[:, 16:] = 1.0
    return {"tokens": torch.randint(0, 128, (4, 64), generator=gen), "loss_mask": mask,
            "advantages": torch.randn(4, 64, generator=gen)}


def _loss_fn(denominator):
    def loss_fn(logprobs, entropy, mb):
        total = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
        return total / denominator, {"pg": torch.stack([total.detach().double(),
                                                        mb["loss_mask"].sum().double()])}

    return loss_fn


def test_bf16_distributed_optimizer_step_on_gpu(qwen2_dir, single_parallel):
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.settings import plain_settings

    base = plain_settings(cuda=True)
    scaled = dataclasses.replace(base, params_dtype="bf16", use_distributed_optimizer=True,
                                 overlap_grad_reduce=True, overlap_param_gather=True)
    batch = _batch()
    denom = float(batch["loss_mask"].sum())
    out = {}
    for name, settings in (("fp32", base), ("bf16", scaled)):
        actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, lr=1e-3, settings=settings)
        first = actor.train_step(batch, _loss_fn(denom), micro_batch_size=2)
        second = actor.train_step(batch, _loss_fn(denom), micro_batch_size=2)
        out[name] = (first, second, actor)
    (f32, s32, _), (f16, s16, actor16) = out["fp32"], out["bf16"]
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in actor16._params.values())
    assert abs(f16["loss"] - f32["loss"]) <= 2e-2 * abs(f32["loss"])
    assert abs(f16["grad_norm"] - f32["grad_norm"]) <= 5e-2 * f32["grad_norm"]
    assert s16["loss"] < f16["loss"] and s32["loss"] < f32["loss"]  # the update helped both
