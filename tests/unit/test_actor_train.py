"""train_step: gradients, grad norm and the Adam update against the HF model under plain torch autograd."""

import math

import pytest
import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.models import name_map

B, S, PROMPT = 4, 12, 5


def make_batch(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S)
    mask[:, PROMPT:] = 1.0
    mask[1, 9:] = 0.0  # a shorter response
    return {"tokens": torch.randint(0, 128, (B, S), generator=gen), "loss_mask": mask,
            "advantages": torch.randn(B, S, generator=gen)}


def pg_loss(denominator: float):
    """Token-mean policy-gradient loss with an explicit global denominator, plus an entropy term."""

    def loss_fn(logprobs, entropy, mb):
        mask = mb["loss_mask"]
        total = -(logprobs * mb["advantages"] * mask).sum() - 0.01 * (entropy * mask).sum()
        metrics = {"pg_loss": torch.stack([total.detach().double(), mask.sum().double()])}
        return total / denominator, metrics

    return loss_fn


def hf_loss(model, batch: dict, denominator: float) -> torch.Tensor:
    tokens, mask = batch["tokens"], batch["loss_mask"]
    logp = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    picked = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    adv, m = batch["advantages"][:, 1:], mask[:, 1:]
    return (-(picked * adv * m).sum() - 0.01 * (entropy * m).sum()) / denominator


def load_hf(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)


def actor_grads_in_hf_names(actor) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in actor._params.items():
        out.update(name_map.megatron_to_hf(name, param.main_grad.clone(), actor.spec))
    return out


def test_gradients_and_grad_norm_match_hf(qwen2_dir, single_parallel):
    batch = make_batch()
    denom = float(batch["loss_mask"].sum())
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, lr=0.0, clip_grad=0.0)
    out = actor.train_step(batch, pg_loss(denom), micro_batch_size=2)
    model = load_hf(qwen2_dir)
    loss = hf_loss(model, batch, denom)
    loss.backward()
    ref_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert out["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    grads = actor_grads_in_hf_names(actor)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Per-micro-batch metrics: (numerator, denominator) of each half of the batch.
    assert len(out["metrics"]) == 2 and not out["skipped"]
    dens = [float(m["pg_loss"][1]) for m in out["metrics"]]
    assert dens == [float(batch["loss_mask"][:2].sum()), float(batch["loss_mask"][2:].sum())]
    assert sum(float(m["pg_loss"][0]) for m in out["metrics"]) / denom == pytest.approx(out["loss"])


def test_clipped_adam_step_matches_torch(llama_dir, single_parallel):
    lr, clip = 1e-3, 0.5
    batch = make_batch(1)
    denom = float(batch["loss_mask"].sum())
    actor = MegatronActor.build(llama_dir, parallel=single_parallel, lr=lr, clip_grad=clip)
    out = actor.train_step(batch, pg_loss(denom), micro_batch_size=1)
    model = load_hf(llama_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    hf_loss(model, batch, denom).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert out["grad_norm"] == pytest.approx(ref_norm, rel=1e-5) and ref_norm > clip
    grads, exported = actor_grads_in_hf_names(actor), dict(actor.export_hf_weights())
    for name, param in model.named_parameters():
        # The actor clips in place: its gradients are now the clipped ones.
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-8, msg=name)
        moved = param.detach() - before[name]
        assert moved.abs().max().item() > 0.5 * lr, name  # Adam's first step: about lr * sign(g)
        # Where |g| is near Adam's eps (1e-8) float noise in g is amplified: compare elsewhere.
        solid = param.grad.abs() > 1e-6
        assert solid.any(), name
        got = (exported[name] - before[name])[solid]
        torch.testing.assert_close(got, moved[solid], rtol=0, atol=1e-3 * lr, msg=name)


def test_micro_batch_size_does_not_change_the_step(qwen3_dir, single_parallel):
    """Gradient accumulation sums micro-batch gradients: no extra 1/num_microbatches."""
    batch = make_batch(2)
    denom = float(batch["loss_mask"].sum())
    results = []
    for micro in (1, 4):
        actor = MegatronActor.build(qwen3_dir, parallel=single_parallel, lr=1e-3, clip_grad=0.0)
        out = actor.train_step(batch, pg_loss(denom), micro_batch_size=micro)
        results.append((out, dict(actor.export_hf_weights())))
    (one, w1), (four, w4) = results
    assert one["grad_norm"] == pytest.approx(four["grad_norm"], rel=1e-5)
    assert one["loss"] == pytest.approx(four["loss"], rel=1e-5)
    assert len(one["metrics"]) == 4 and len(four["metrics"]) == 1
    for name in w1:
        torch.testing.assert_close(w1[name], w4[name], rtol=0, atol=1e-5, msg=name)


def test_non_finite_loss_skips_the_update(qwen2_dir, single_parallel):
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, lr=1e-2)
    before = dict(actor.export_hf_weights())

    def nan_loss(logprobs, entropy, mb):
        return logprobs.sum() * float("nan"), {}

    out = actor.train_step(make_batch(), nan_loss, micro_batch_size=4)
    assert out["skipped"] and not math.isfinite(out["grad_norm"])
    after = dict(actor.export_hf_weights())
    assert all(torch.equal(before[n], after[n]) for n in before)
    # The next, finite step updates normally.
    out = actor.train_step(make_batch(), pg_loss(10.0), micro_batch_size=4)
    assert not out["skipped"] and math.isfinite(out["grad_norm"])
    moved = dict(actor.export_hf_weights())
    assert not torch.equal(moved["model.norm.weight"], before["model.norm.weight"])


def test_learning_rate_is_settable(qwen2_dir, single_parallel):
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, lr=3e-4)
    assert actor.lr == pytest.approx(3e-4)
    actor.set_lr(1e-5)
    assert actor.lr == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="lr=-1"):
        actor.set_lr(-1.0)
