"""The actor with an emulated FP8 recipe: the BF16 shadow (fp8=False) is the plain model bitwise."""

import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.fp8 import Fp8Recipe


def test_fp8_actor_and_its_shadow(qwen2_dir, single_parallel):
    gen = torch.Generator().manual_seed(4)
    batch = {"tokens": torch.randint(0, 128, (2, 16), generator=gen), "loss_mask": torch.ones(2, 16)}
    plain = MegatronActor.build(qwen2_dir, parallel=single_parallel)
    fp8 = MegatronActor.build(qwen2_dir, parallel=single_parallel, fp8_recipe=Fp8Recipe("blockwise"))
    ref = plain.compute_logprobs(batch, micro_batch_size=2)["logprobs"]
    shadow = fp8.compute_logprobs(batch, micro_batch_size=2, fp8=False)["logprobs"]
    quantized = fp8.compute_logprobs(batch, micro_batch_size=2)["logprobs"]
    assert torch.equal(shadow, ref)
    diff = (quantized - ref).abs().max().item()
    assert 0 < diff < 0.5  # FP8 noise: present, and small against log-probs of about -5
    # Parameters and HF export are the same tensors either way (no fp8-only copies).
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain.export_hf_weights(),
                                                          fp8.export_hf_weights()))
    out = fp8.train_step(dict(batch, advantages=torch.ones(2, 16)),
                         lambda lp, ent, mb: (-(lp * mb["advantages"]).sum() / 32.0, {}),
                         micro_batch_size=1)
    assert not out["skipped"] and out["grad_norm"] > 0
