"""Every training recipe on the real model's shapes, whose hidden size 576 is 4.5 blocks of 128 and
whose k/v projections are 192 = 1.5 blocks: partial blocks are quantized as if zero-padded (TE's
ceil-div scale layout), so each recipe trains; the BF16 shadow over all 30 layers is the plain
model bitwise and calibration matches BF16's clip share after an update. The recipes run on the
first two real layers (the same shapes, a fifteenth of the time); shadow and calibration on all 30."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.algo.calib_solve import Rules
from megatron_rl.algo.calibrated_clip import calibrate_bounds
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


def test_shadow_and_calibration_over_all_30_layers(smollm2_dir, smollm2_tokenizer, single_parallel):
    """The BF16 shadow is the plain model bitwise; after one update, the calibrated lower bound L
    clips the same share of negative-advantage tokens under FP8 as 1 - eps_low does under BF16."""
    tokens = chat_tokens(smollm2_tokenizer)
    adv = torch.tensor([[1.0], [-1.0]]).expand(tokens.shape).contiguous()
    batch = {"tokens": tokens, "loss_mask": torch.ones(tokens.shape), "advantages": adv}
    plain = MegatronActor.build(smollm2_dir, parallel=single_parallel, frozen=True)
    fp8 = MegatronActor.build(smollm2_dir, parallel=single_parallel, fp8_recipe=Fp8Recipe("blockwise"), lr=3e-6)

    def logprobs(actor, quantized=True):
        return actor.compute_logprobs(batch, micro_batch_size=2, fp8=quantized, with_entropy=False)["logprobs"][:, 1:]

    ref = logprobs(plain)
    assert torch.equal(logprobs(fp8, quantized=False), ref)
    old_fp8, old_bf16 = logprobs(fp8), ref
    log_ratio = old_fp8 - old_bf16
    print(f"blockwise FP8 vs BF16 over 30 layers: log-ratio std {log_ratio.std():.3g}, max {log_ratio.abs().max():.3g}")
    # Measured 0.44-0.56: the real model's residual stream carries massive activations (abs max
    # ~2.5e4 from layer 5 on, median 2-7), which a shared FP8 scale cannot hold with the rest.
    assert 0.05 < log_ratio.std() < 1.0
    assert not fp8.train_step(batch, pg_loss, micro_batch_size=2)["skipped"]
    r_fp8, r_bf16 = (logprobs(fp8) - old_fp8).exp(), (logprobs(fp8, quantized=False) - old_bf16).exp()
    negative = adv[:, 1:] < 0
    low, high = calibrate_bounds(r_fp8, r_bf16, adv[:, 1:], torch.ones_like(r_fp8), eps_low=0.2, eps_high=0.2,
                                 rules=Rules(alpha_tolerance_tokens=0.0))
    alpha = (r_bf16[negative] < 0.8).float().mean().item()
    clipped_fp8 = (r_fp8[negative] < low).float().mean().item()
    print(f"after one update: BF16 lower-clips {alpha:.3f} of A<0 tokens; L = {low:.4f}, H = {high:.4f} "
          f"clips {clipped_fp8:.3f} under FP8 (0.8 would clip {(r_fp8[negative] < 0.8).float().mean():.3f})")
    assert alpha > 0  # the update moved the negative sample's tokens down: there is something to match
    assert (r_fp8[negative] < 0.8).float().mean().item() != alpha and low != 0.8  # FP8 noise: 0.8 is off
    assert abs(clipped_fp8 - alpha) <= 1.0 / negative.sum().item() + 1e-9  # within one token
