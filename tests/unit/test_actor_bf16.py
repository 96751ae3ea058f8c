"""BF16 parameters (Float16Module + mixed-precision optimizer) against the FP32 actor, on CPU."""

import torch

from megatron_rl.actor.actor import MegatronActor
from test_actor_train import make_batch, pg_loss


def _main_params(actor) -> dict[str, torch.Tensor]:
    """HF-independent view: Megatron name -> FP32 main parameter (the optimizer's copy)."""
    out = {}
    for name, param in actor._params.items():
        main = getattr(param, "main_param", None)
        out[name] = (param if main is None else main).detach().clone()
    return out


def test_bf16_step_matches_fp32_within_bf16_tolerance(qwen2_dir, single_parallel):
    batch = make_batch()
    denom = float(batch["loss_mask"].sum())
    fp32 = MegatronActor.build(qwen2_dir, parallel=single_parallel, lr=1e-3, clip_grad=0.0)
    bf16 = MegatronActor.build(qwen2_dir, parallel=single_parallel, lr=1e-3, clip_grad=0.0,
                               params_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16._params.values())
    before = {"fp32": _main_params(fp32), "bf16": _main_params(bf16)}
    for name, main in before["bf16"].items():  # FP32 main params start from the BF16 weights
        assert main.dtype == torch.float32
        assert torch.equal(main, bf16._params[name].float())
    out32 = fp32.train_step(batch, pg_loss(denom), micro_batch_size=2)
    out16 = bf16.train_step(batch, pg_loss(denom), micro_batch_size=2)
    assert all(p.main_grad.dtype == torch.float32 for p in bf16._params.values())
    assert abs(out16["loss"] - out32["loss"]) <= 2e-2 * abs(out32["loss"])
    assert abs(out16["grad_norm"] - out32["grad_norm"]) <= 5e-2 * out32["grad_norm"]
    after = {"fp32": _main_params(fp32), "bf16": _main_params(bf16)}
    num = den = 0.0
    for name, param in bf16._params.items():
        main = after["bf16"][name]
        assert main.dtype == torch.float32
        assert torch.equal(param.detach(), main.to(torch.bfloat16))  # model copy = main, rounded
        d16 = main - before["bf16"][name]
        d32 = after["fp32"][name] - before["fp32"][name]
        num += float((d16 - d32).pow(2).sum())
        den += float(d32.pow(2).sum())
    assert den > 0 and (num / den) ** 0.5 < 0.25, (num / den) ** 0.5


def test_bf16_forward_computes_in_bf16(qwen2_dir, single_parallel):
    batch = make_batch(1)
    fp32 = MegatronActor.build(qwen2_dir, parallel=single_parallel)
    bf16 = MegatronActor.build(qwen2_dir, parallel=single_parallel, params_dtype=torch.bfloat16)
    lp32 = fp32.compute_logprobs(batch, micro_batch_size=4)["logprobs"]
    lp16 = bf16.compute_logprobs(batch, micro_batch_size=4)["logprobs"]
    diff = (lp16 - lp32).abs().max().item()
    # BF16 rounding is visible (not an FP32 forward in disguise) and bounded.
    assert 1e-4 < diff < 5e-2, diff
