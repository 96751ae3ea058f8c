"""The actor loaded from a tiny HF folder gives the HF model's own per-token log-probs and entropy."""

import pytest
import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.models.tiny import make_tiny_hf_model

TOL = 1e-4  # fp32, the bound; measured ~1e-6


def hf_reference(hf_dir, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow obvious reference: full-vocab log_softmax of the HF model, aligned like the actor."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    picked = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = torch.zeros(tokens.shape[0], 1)
    return torch.cat((zero, picked), 1), torch.cat((zero, entropy), 1)


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", False), ("qwen2", True),
                                        ("qwen3", False), ("qwen3", True)])
def test_logprobs_match_hf(arch, tied, tiny_hf_factory, single_parallel):
    hf_dir = tiny_hf_factory(arch, tie_word_embeddings=tied)
    actor = MegatronActor.build(hf_dir, parallel=single_parallel)
    tokens = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens, "loss_mask": torch.ones(3, 24)}
    out = actor.compute_logprobs(batch, micro_batch_size=1)
    ref_lp, ref_ent = hf_reference(hf_dir, tokens)
    lp_diff = (out["logprobs"] - ref_lp).abs().max().item()
    ent_diff = (out["entropy"] - ref_ent).abs().max().item()
    print(f"{arch} tied={tied}: max |dlogp| {lp_diff:.2e}, max |dH| {ent_diff:.2e}")
    assert lp_diff <= TOL and ent_diff <= TOL
    assert out["logprobs"][:, 0].abs().max() == 0  # no prediction for the first token
    assert (out["logprobs"][:, 1:] < 0).all()
    only = actor.compute_logprobs(batch, micro_batch_size=3, with_entropy=False)
    assert set(only) == {"logprobs"}
    torch.testing.assert_close(only["logprobs"], out["logprobs"], rtol=0, atol=1e-6)


def test_random_init_is_seeded_and_differs_from_hf(single_parallel):
    """A ModelSpec builds a random model (no weights read): same seed, same weights."""
    from megatron_rl.models.hf_config import ModelSpec
    from megatron_rl.models.tiny import tiny_hf_config

    spec = ModelSpec.from_hf_config(tiny_hf_config("qwen2"))
    a = dict(MegatronActor.build(spec, parallel=single_parallel, seed=3).export_hf_weights())
    b = dict(MegatronActor.build(spec, parallel=single_parallel, seed=3).export_hf_weights())
    hf = make_tiny_hf_model("qwen2", None).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], hf[name])
