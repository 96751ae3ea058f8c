"""Every training recipe on the real model's shapes, whose hidden size 576 is 4.5 blocks of 128 and
whose k/v projections are 192 = 1.5 blocks: partial blocks are quantized as if zero-padded (TE's
ceil-div scale layout), so each recipe trains; the BF16 shadow over all 30 layers is the plain
model bitwise. The recipes run on the first two real layers (the same shapes, a fifteenth of the
time); the shadow on the whole model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.fp8 import Fp8Recipe
from megatron_rl.fp8.recipe import FP4_RECIPES, RECIPES

QUANTIZED = [r for r in RECIPES if r != "bf16"]


@pytest.fixture(scope="module")
def two_layers(smollm2_dir, tmp_path_factory):
    """Layers 0-1 of the real model with its embedding and final norm: every linear shape of it."""
    out = tmp_path_factory.mktemp("smollm2_2layers")
    config = json.loads((smollm2_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    keep = {k: v for k, v in load_file(smollm2_dir / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    save_file(keep, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, out / name)
    return out


def chat_tokens(tokenizer) -> torch.Tensor:
    chat = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"},
            {"role": "assistant", "content": "3 + 4 = 7. The answer is 7."}]
    ids = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
    return torch.tensor([ids, ids[:-6] + [2] * 6])


def pg_loss(lp, ent, mb):
    return -(lp * mb["advantages"] * mb["loss_mask"]).sum() / mb["loss_mask"].sum(), {}


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_each_recipe_trains_on_the_real_shapes(recipe, two_layers, smollm2_tokenizer, single_parallel):
    tokens = chat_tokens(smollm2_tokenizer)
    batch = {"tokens": tokens, "loss_mask": torch.ones(tokens.shape), "advantages": torch.tensor([[1.0], [-1.0]])
             .expand(tokens.shape).contiguous()}
    actor = MegatronActor.build(two_layers, parallel=single_parallel, fp8_recipe=Fp8Recipe(recipe), lr=1e-4)
    shadow = actor.compute_logprobs(batch, micro_batch_size=2, fp8=False)["logprobs"][:, 1:]
    quantized = actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"][:, 1:]
    noise = (quantized - shadow).abs().mean().item()
    print(f"{recipe}: mean |dlogp| vs the BF16 shadow {noise:.3g}")
    bound = 2.0 if recipe in FP4_RECIPES else 0.5  # the 2-layer truncation's log-probs are ~ -20: loose
    assert torch.isfinite(quantized).all() and 0 < noise < bound
    before = {n: t.clone() for n, t in actor.export_hf_weights()}
    out = actor.train_step(batch, pg_loss, micro_batch_size=1)
    assert not out["skipped"] and 0 < out["grad_norm"] < float("inf")
    after = dict(actor.export_hf_weights())
    linears = [n for n in before if n.endswith("proj.weight")]
    assert len(linears) == 14 and all(not torch.equal(before[n], after[n]) for n in linears)


def test_the_bf16_shadow_of_all_30_layers_is_the_plain_model(smollm2_dir, smollm2_tokenizer, single_parallel):
    tokens = chat_tokens(smollm2_tokenizer)
    batch = {"tokens": tokens, "loss_mask": torch.ones(tokens.shape)}
    plain = MegatronActor.build(smollm2_dir, parallel=single_parallel, frozen=True)
    fp8 = MegatronActor.build(smollm2_dir, parallel=single_parallel, fp8_recipe=Fp8Recipe("blockwise"), frozen=True)
    ref = plain.compute_logprobs(batch, micro_batch_size=2, with_entropy=False)["logprobs"]
    assert torch.equal(fp8.compute_logprobs(batch, micro_batch_size=2, fp8=False, with_entropy=False)["logprobs"], ref)
    log_ratio = (fp8.compute_logprobs(batch, micro_batch_size=2, with_entropy=False)["logprobs"] - ref)[:, 1:]
    print(f"blockwise FP8 vs BF16 over 30 layers: log-ratio std {log_ratio.std():.3g}, max {log_ratio.abs().max():.3g}")
    # Measured 0.44-0.56: the real model's residual stream carries massive activations (abs max
    # ~2.5e4 from layer 5 on, median 2-7), which a shared FP8 scale cannot hold with the rest.
    assert 0.05 < log_ratio.std() < 1.0
