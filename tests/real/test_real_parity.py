"""The real model through the project's converters and its Megatron actor: HF -> Megatron
(TP = 3, PP = 2) -> HF bitwise, and the actor's per-token log-probs and entropy on real chat text
against transformers' own forward (the slow obvious reference)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_rl.convert.megatron_to_hf import convert_megatron_to_hf

TOL = 1e-4  # nats, fp32; measured 2.6e-5 over 30 layers


def test_hf_megatron_hf_round_trip_is_bitwise(smollm2_dir, tmp_path):
    convert_hf_to_megatron(smollm2_dir, tmp_path / "mcore", tp=3, pp=2, progress=False)
    convert_megatron_to_hf(tmp_path / "mcore", tmp_path / "hf", progress=False)
    before = load_file(smollm2_dir / "model.safetensors")
    after = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(after) == sorted(before)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == []
    tokenizer_files = {p.name for p in (tmp_path / "hf").iterdir()} & {"tokenizer.json", "chat_template.jinja"}
    assert tokenizer_files == {"tokenizer.json", "chat_template.jinja"}


def chat_batch(tokenizer) -> torch.Tensor:
    """Two real conversations, right-padded with <|im_end|> to one length: [2, S] int64."""
    chats = [[{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"},
              {"role": "assistant", "content": "Tom has 3 + 4 = 7 apples. The answer is 7."}],
             [{"role": "system", "content": "Answer with a number."},
              {"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "19"}]]
    rows = [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rows]
    width = max(map(len, ids))
    return torch.tensor([row + [2] * (width - len(row)) for row in ids])


def test_actor_logprobs_match_transformers_on_chat_text(smollm2_dir, smollm2_tokenizer, smollm2_model,
                                                        single_parallel):
    tokens = chat_batch(smollm2_tokenizer)
    with torch.no_grad():
        logp = torch.log_softmax(smollm2_model(tokens).logits.float(), dim=-1)
    ref = logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    ref_entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    actor = MegatronActor.build(smollm2_dir, parallel=single_parallel)
    out = actor.compute_logprobs({"tokens": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.float32)},
                                 micro_batch_size=2)
    diff = (out["logprobs"][:, 1:] - ref).abs().max().item()
    entropy_diff = (out["entropy"][:, 1:] - ref_entropy).abs().max().item()
    print(f"SmolLM2-135M actor vs transformers: max |dlogp| {diff:.2e}, max |dH| {entropy_diff:.2e}")
    assert diff <= TOL and entropy_diff <= TOL
    # The model knows this text: the answer tokens of the second chat are likely, not uniform (ln 49152 = 10.8).
    assert ref.mean() > -4.0
