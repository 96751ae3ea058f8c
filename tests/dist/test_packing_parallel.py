"""Chunked log-probs and packed micro-batches over 2 real gloo processes: at TP=2 the chunked kernel
matches a full-softmax reference, and at TP=2 and PP=2 packed rows give what padded rows give."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _launch import run_distributed

LAYOUTS = [("tp2", 2, 1), ("pp2", 1, 2)]


def kernel_inputs():
    gen = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(9, 32, generator=gen)
    rows = torch.tensor([0, 1, 4, 5, 8])
    return logits, rows, torch.randint(0, 32, (5,), generator=gen), torch.randn(2, 5, generator=gen)


def chunked_on_shard(parallel) -> dict:
    from megatron_rl.actor.logprobs import chunked_logprobs_and_entropy

    logits, rows, targets, weights = kernel_inputs()
    shard = logits.chunk(2, dim=-1)[parallel.tp_rank].clone().requires_grad_()
    lp, ent = chunked_logprobs_and_entropy(shard, rows, targets, 2, parallel.tp_group)
    (lp * weights[0] + ent * weights[1]).sum().backward()
    return {"logprobs": lp.detach(), "entropy": ent.detach(), "grad": shard.grad}


def packed_vs_padded(parallel, hf_dir) -> dict:
    import test_actor_packing as t  # the unit test's batch and loss, shared
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.packing import pack_batch, unpack
    from megatron_rl.algo.policy_loss import loss_denominator

    batch = t._rl_batch(6, 14, seed=5)
    mode = "seq-mean-token-mean"
    denominator = float(loss_denominator(batch["loss_mask"], mode))
    packed, index = pack_batch(batch, budget=20, multiple=16)
    out = {}
    for name, actor_batch, mbs in (("padded", batch, 2), ("packed", packed, 1)):
        actor = MegatronActor.build(hf_dir, parallel=parallel, lr=1e-2)
        lp = actor.compute_logprobs(actor_batch, micro_batch_size=mbs, logprob_chunk_size=4)["logprobs"]
        step = actor.train_step(actor_batch, t._policy_loss_fn(mode, denominator), micro_batch_size=mbs,
                                logprob_chunk_size=4)
        out[name] = {"logprobs": lp if name == "padded" else unpack(lp, index), "loss": step["loss"],
                     "grad_norm": step["grad_norm"]}
    return out


def worker(rank: int, world_size: int, hf_dir: str) -> dict:
    sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # for test_actor_packing's helpers
    from megatron_rl.actor.parallel import init_parallel

    results = {"kernel": chunked_on_shard(init_parallel(2, 1))}
    for name, tp, pp in LAYOUTS:
        results[name] = packed_vs_padded(init_parallel(tp, pp, seed=0), hf_dir)
    return results


@pytest.fixture(scope="module")
def distributed(qwen3_dir) -> list[dict]:
    return run_distributed(worker, world_size=2, args=(str(qwen3_dir),), timeout_s=180)


def test_chunked_kernel_at_tp2(distributed):
    """Slow obvious reference: full-vocab log_softmax under autograd, in this process."""
    logits, rows, targets, weights = kernel_inputs()
    logits.requires_grad_()
    logp = torch.log_softmax(logits[rows], dim=-1)
    ref_lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp * weights[0] + ref_ent * weights[1]).sum().backward()
    ranks = [distributed[r]["kernel"] for r in range(2)]
    for rank in ranks:
        torch.testing.assert_close(rank["logprobs"], ref_lp.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rank["entropy"], ref_ent.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks], dim=-1), logits.grad,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS])
def test_packed_equals_padded(distributed, name):
    for rank in range(2):
        padded, packed = distributed[rank][name]["padded"], distributed[rank][name]["packed"]
        assert padded["logprobs"].abs().sum() > 0
        torch.testing.assert_close(packed["logprobs"], padded["logprobs"], rtol=0, atol=1e-6)
        assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-6)
        assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
