"""TP=2, PP=2 and DP=2 over 2 real gloo processes give what TP=PP=DP=1 gives in this process.

One launch runs every layout (imports dominate the cost); the reference runs here, single-process.
Compared: log-probs, entropy, loss, grad norm, the exported weights before the step (exactly the
HF checkpoint) and the log-probs after one optimizer step.
"""

from __future__ import annotations

import pytest
import torch
from _launch import run_distributed
from safetensors.torch import load_file

# (name, tp, pp, arch, tied)
LAYOUTS = [("tp2_llama", 2, 1, "llama", False), ("tp2_qwen2", 2, 1, "qwen2", False),
           ("tp2_qwen3_tied", 2, 1, "qwen3", True), ("pp2_qwen2", 1, 2, "qwen2", False),
           ("pp2_qwen3_tied", 1, 2, "qwen3", True), ("dp2_qwen2", 1, 1, "qwen2", False)]
B, S, MICRO = 4, 12, 2
REL = 1e-5  # the bound for TP/PP vs 1


def make_batch() -> dict:
    gen = torch.Generator().manual_seed(7)
    mask = torch.zeros(B, S)
    mask[:, 4:] = 1.0
    mask[2, 10:] = 0.0
    return {"tokens": torch.randint(0, 128, (B, S), generator=gen), "loss_mask": mask,
            "advantages": torch.randn(B, S, generator=gen)}


def loss_fn_for(denominator: float):
    def loss_fn(logprobs, entropy, mb):
        mask = mb["loss_mask"]
        total = -(logprobs * mb["advantages"] * mask).sum() - 0.01 * (entropy * mask).sum()
        return total / denominator, {"pg": torch.stack([total.detach().double(), mask.sum().double()])}

    return loss_fn


def run_layout(parallel, hf_dir, batch: dict) -> dict:
    """What every layout reports: logprobs/entropy, a train step, exports before and after."""
    from megatron_rl.actor.actor import MegatronActor

    actor = MegatronActor.build(hf_dir, parallel=parallel, lr=1e-3, clip_grad=1.0)
    exported = dict(actor.export_hf_weights())
    out = actor.compute_logprobs(batch, micro_batch_size=MICRO)
    denom = float(make_batch()["loss_mask"].sum())  # GLOBAL denominator, also under DP
    step = actor.train_step(batch, loss_fn_for(denom), micro_batch_size=MICRO)
    after = actor.compute_logprobs(batch, micro_batch_size=MICRO)
    # the frozen reference policy (KL): sharded as the actor, the same log-probs as its first pass
    frozen = MegatronActor.build(hf_dir, parallel=parallel, frozen=True)
    return {"logprobs": out["logprobs"], "entropy": out["entropy"], "loss": step["loss"],
            "grad_norm": step["grad_norm"], "metrics": step["metrics"], "exported": exported,
            "logprobs_after": after["logprobs"],
            "frozen_logprobs": frozen.compute_logprobs(batch, micro_batch_size=MICRO)["logprobs"]}


def kernel_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(2, 5, 32, generator=gen)
    return logits, torch.randint(0, 32, (2, 5), generator=gen), torch.randn(2, 5, generator=gen)


def kernel_on_shard(parallel) -> dict:
    """vocab_parallel_logprobs_and_entropy on this TP rank's vocab half, with its gradient."""
    from megatron_rl.actor.logprobs import vocab_parallel_logprobs_and_entropy

    logits, targets, weights = kernel_inputs()
    shard = logits.chunk(parallel.tp_size, dim=-1)[parallel.tp_rank].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_and_entropy(shard, targets, parallel.tp_group)
    ((lp + 0.5 * ent) * weights).sum().backward()
    return {"logprobs": lp.detach(), "entropy": ent.detach(), "grad": shard.grad}


def worker(rank: int, world_size: int, hf_dirs: dict) -> dict:
    from megatron_rl.actor.parallel import init_parallel

    results = {"kernel": kernel_on_shard(init_parallel(2, 1))}
    for name, tp, pp, _, _ in LAYOUTS:
        parallel = init_parallel(tp, pp, seed=0)
        batch = make_batch()
        if name.startswith("dp2"):  # each DP rank takes its half of the global batch
            rows = slice(parallel.dp_rank * B // 2, (parallel.dp_rank + 1) * B // 2)
            batch = {k: v[rows] for k, v in batch.items()}
        results[name] = run_layout(parallel, hf_dirs[name], batch)
    return results


@pytest.fixture(scope="module")
def hf_dirs(tiny_hf_factory) -> dict:
    return {name: str(tiny_hf_factory(arch, tie_word_embeddings=tied))
            for name, _, _, arch, tied in LAYOUTS}


@pytest.fixture(scope="module")
def distributed(hf_dirs) -> list[dict]:
    return run_distributed(worker, world_size=2, args=(hf_dirs,), timeout_s=180)


@pytest.fixture(scope="module")
def reference(hf_dirs, single_parallel) -> dict:
    return {name: run_layout(single_parallel, hf_dirs[name], make_batch()) for name in hf_dirs}


def test_logprob_kernel_gradient_at_tp2(distributed):
    """Slow obvious reference: full-vocab log_softmax under autograd, in this process."""
    logits, targets, weights = kernel_inputs()
    logits.requires_grad_()
    logp = torch.log_softmax(logits, dim=-1)
    ref_lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ((ref_lp + 0.5 * ref_ent) * weights).sum().backward()
    ranks = [distributed[r]["kernel"] for r in range(2)]
    for rank in ranks:
        torch.testing.assert_close(rank["logprobs"], ref_lp.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank["entropy"], ref_ent.detach(), rtol=1e-5, atol=1e-6)
    grad = torch.cat([r["grad"] for r in ranks], dim=-1)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-6)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS])
def test_layout_matches_single_process(name, distributed, reference, hf_dirs):
    ref = reference[name]
    ranks = [distributed[r][name] for r in range(2)]
    if name.startswith("dp2"):
        got = {k: torch.cat([r[k] for r in ranks]) for k in ("logprobs", "entropy", "logprobs_after", "frozen_logprobs")}
        got["loss"] = ranks[0]["loss"] + ranks[1]["loss"]  # each rank sums its own micro-batches
    else:
        got = ranks[0]
        for key in ("logprobs", "entropy", "logprobs_after", "frozen_logprobs"):  # every TP / PP rank returns them
            assert torch.equal(ranks[1][key], got[key]), key
        assert ranks[1]["loss"] == got["loss"] and ranks[1]["metrics"][0]["pg"].equal(got["metrics"][0]["pg"])
    assert torch.equal(got["frozen_logprobs"], got["logprobs"])  # the reference is the initial policy
    diffs = {k: rel_diff(got[k], ref[k]) for k in ("logprobs", "entropy", "logprobs_after", "frozen_logprobs")}
    diffs["loss"] = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    diffs["grad_norm"] = abs(ranks[0]["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    print(name, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert ranks[1]["grad_norm"] == ranks[0]["grad_norm"]
    for key, value in diffs.items():
        assert value <= REL, (key, value)


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS if not layout[0].startswith("dp")])
def test_export_reproduces_the_checkpoint(name, distributed, hf_dirs):
    original = load_file(f"{hf_dirs[name]}/model.safetensors")
    if name.startswith("tp2"):  # every TP rank gets the full tensors
        exported = distributed[0][name]["exported"]
        assert all(torch.equal(distributed[1][name]["exported"][n], t) for n, t in exported.items())
    else:  # each PP stage exports its own layers; together they are the model
        first, last = (distributed[r][name]["exported"] for r in range(2))
        assert not set(first) & set(last)
        assert "model.embed_tokens.weight" in first and "model.norm.weight" in last
        exported = {**first, **last}
    assert sorted(exported) == sorted(original)
    for hf_name, tensor in original.items():
        assert torch.equal(exported[hf_name], tensor), hf_name
