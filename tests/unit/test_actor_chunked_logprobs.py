"""Chunked, response-only log-probs / entropy against a full-softmax reference, and through the actor."""

import pytest
import torch

from megatron_rl.actor.logprobs import chunked_logprobs_and_entropy


def reference(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor):
    """Slow obvious reference: full log_softmax over the selected rows."""
    logp = torch.log_softmax(logits[rows].double(), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_matches_full_softmax_values_and_grads(chunk):
    gen = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(11, 40, generator=gen, dtype=torch.float64)).requires_grad_()
    rows = torch.tensor([0, 2, 3, 7, 8, 10])
    targets = torch.randint(0, 40, (6,), generator=gen)
    lp, ent = chunked_logprobs_and_entropy(logits, rows, targets, chunk)
    ref_logits = logits.detach().clone().requires_grad_()
    ref_lp, ref_ent = reference(ref_logits, rows, targets)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-6, atol=1e-6)
    w_lp, w_ent = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    (lp * w_lp + ent * w_ent).sum().backward()
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)
    assert logits.grad[[1, 4, 5, 6, 9]].abs().max() == 0  # unselected rows get no gradient


def test_chunked_one_output_used_and_bad_chunk():
    logits = torch.zeros(2, 4, requires_grad=True)
    lp, _ = chunked_logprobs_and_entropy(logits, torch.tensor([1]), torch.tensor([2]), 8)
    assert lp.item() == pytest.approx(-torch.log(torch.tensor(4.0)).item())
    lp.sum().backward()  # d logp / d z = onehot - softmax = onehot - 1/4
    assert logits.grad.tolist() == [[0, 0, 0, 0], [-0.25, -0.25, 0.75, -0.25]]
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_logprobs_and_entropy(logits, torch.tensor([1]), torch.tensor([2]), 0)


def test_actor_chunked_equals_whole_on_response_tokens(qwen3_dir, single_parallel):
    """Same log-probs, entropy, loss and gradients on loss-mask tokens; 0 elsewhere."""
    from megatron_rl.actor.actor import MegatronActor

    gen = torch.Generator().manual_seed(4)
    mask = torch.zeros(2, 12)
    mask[0, 3:10], mask[1, 5:] = 1.0, 1.0
    batch = {"tokens": torch.randint(0, 128, (2, 12), generator=gen), "loss_mask": mask,
             "advantages": torch.randn(2, 12, generator=gen)}

    def loss_fn(logprobs, entropy, mb):
        m = mb["loss_mask"]
        total = -(logprobs * mb["advantages"] * m).sum() - 0.1 * (entropy * m).sum()
        return total / 10.0, {"n": torch.stack([total.detach().double(), m.sum().double()])}

    results = []
    for chunk in (0, 3):
        actor = MegatronActor.build(qwen3_dir, parallel=single_parallel, lr=1e-2)
        out = actor.compute_logprobs(batch, micro_batch_size=1, logprob_chunk_size=chunk)
        step = actor.train_step(batch, loss_fn, micro_batch_size=1, logprob_chunk_size=chunk)
        grads = [p.main_grad.clone() if hasattr(p, "main_grad") else p.grad.clone()
                 for p in actor.model[0].parameters()]
        results.append((out, step, grads))
    (whole, step_w, grads_w), (chunked, step_c, grads_c) = results
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(chunked[key], whole[key] * mask, rtol=0, atol=1e-6)
    assert chunked["logprobs"][0, :3].abs().max() == 0 and whole["logprobs"][0, 1] != 0
    assert step_c["loss"] == pytest.approx(step_w["loss"], rel=1e-6)
    assert step_c["grad_norm"] == pytest.approx(step_w["grad_norm"], rel=1e-5)
    assert all(g.abs().sum() > 0 for g in grads_c)
    for g_c, g_w in zip(grads_c, grads_w):
        torch.testing.assert_close(g_c, g_w, rtol=1e-5, atol=1e-7)
