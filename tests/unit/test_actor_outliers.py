"""Planted activation outliers: the function is preserved, the norm outputs grow s times, FP4 (and FP8 far out) feel them.

`python tests/unit/test_actor_outliers.py` prints the FP8 / FP4 error numbers quoted in docs/fp8.md.
"""

import pytest
import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.forward import unwrap_model
from megatron_rl.actor.outliers import choose_outlier_channels
from megatron_rl.fp8 import Fp8Recipe

K, SCALE, SEED = 4, 30.0, 7


def make_batch(seed: int = 0) -> dict:
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tokens, "loss_mask": torch.ones(4, 32)}


def logprobs(actor, batch, fp8=True) -> torch.Tensor:
    return actor.compute_logprobs(batch, micro_batch_size=2, fp8=fp8, with_entropy=False)["logprobs"][:, 1:]


def norm_amax(actor, batch) -> dict[str, torch.Tensor]:
    """Per-channel max |output| of every pre-attention / pre-MLP norm, read by forward hooks."""
    amax, hooks = {}, []
    for i, layer in enumerate(unwrap_model(actor.model[0]).decoder.layers):
        for kind in ("input_layernorm", "pre_mlp_layernorm"):
            def hook(_mod, _inp, out, key=f"{i}.{kind}"):
                amax[key] = out.detach().abs().flatten(0, -2).amax(0)
            hooks.append(getattr(layer, kind).register_forward_hook(hook))
    logprobs(actor, batch, fp8=False)
    for h in hooks:
        h.remove()
    return amax


def test_channels_are_distinct_sorted_and_seeded():
    chosen = choose_outlier_channels(64, 5, seed=SEED)
    assert chosen == sorted(set(chosen)) and len(chosen) == 5 and all(0 <= c < 64 for c in chosen)
    assert chosen == choose_outlier_channels(64, 5, seed=SEED)
    assert chosen != choose_outlier_channels(64, 5, seed=SEED + 1)
    assert choose_outlier_channels(64, 0, seed=SEED) == []
    with pytest.raises(ValueError, match="model.outlier_channels"):
        choose_outlier_channels(64, 65, seed=SEED)


def test_planting_rescales_exactly_the_chosen_columns(qwen2_dir, single_parallel):
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel)
    before = {n: t.clone() for n, t in actor.export_hf_weights()}
    channels = actor.plant_outliers(K, SCALE, seed=SEED)
    after = dict(actor.export_hf_weights())
    others = [c for c in range(before["model.norm.weight"].numel()) if c not in channels]
    for name, old in before.items():
        new = after[name]
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            torch.testing.assert_close(new[channels], old[channels] * SCALE)
            assert torch.equal(new[others], old[others])
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            torch.testing.assert_close(new[:, channels], old[:, channels] / SCALE)
            assert torch.equal(new[:, others], old[:, others])
        else:  # embeddings, biases, o_proj, down_proj, final norm, lm_head
            assert torch.equal(new, old), name


@pytest.mark.parametrize("dtype,scale,rtol", [(torch.float32, SCALE, 1e-5), (torch.bfloat16, 32.0, 0.0)])
def test_planting_preserves_the_function_and_grows_the_norm_outputs(qwen2_dir, single_parallel, dtype, scale, rtol):
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, params_dtype=dtype)
    batch = make_batch()
    ref, ref_amax = logprobs(actor, batch, fp8=False), norm_amax(actor, batch)
    channels = actor.plant_outliers(K, scale, seed=SEED)
    out, amax = logprobs(actor, batch, fp8=False), norm_amax(actor, batch)
    # FP32 and s=30: rounding of gamma and W only. BF16 and a power-of-two s: every product is the same.
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * ref.abs().max().item())
    others = [c for c in range(ref_amax["0.input_layernorm"].numel()) if c not in channels]
    for key in ref_amax:
        ratio = amax[key].float() / ref_amax[key].float()
        torch.testing.assert_close(ratio[channels], torch.full((K,), scale), rtol=1e-2, atol=0.0)
        torch.testing.assert_close(ratio[others], torch.ones(len(others)), rtol=1e-2, atol=0.0)


def fp8_error(model_dir, parallel, scale: float, recipe: str = "tensorwise") -> float:
    """Mean |logp_fp8 - logp_bf16| of `recipe` after planting K channels x scale (1: none)."""
    actor = MegatronActor.build(model_dir, parallel=parallel, fp8_recipe=Fp8Recipe.from_contract(recipe, "hybrid"))
    if scale > 1:
        actor.plant_outliers(K, scale, seed=SEED)
    batch = make_batch()
    return (logprobs(actor, batch) - logprobs(actor, batch, fp8=False)).abs().mean().item()


def test_tensorwise_fp8_feels_outliers_only_past_its_dynamic_range(qwen2_dir, single_parallel):
    """E4M3 spans 2^-9 .. 448 (2^17.8): a per-tensor scale set by a 32x outlier leaves the other
    channels in the normal range with the same relative rounding, so the error does not grow; from
    about 2^15 the bulk falls into subnormals and it does. Measured (docs/fp8.md): 0.074 plain,
    0.065 at s=32, 0.173 at s=2^15."""
    plain = fp8_error(qwen2_dir, single_parallel, 1.0)
    llm_like = fp8_error(qwen2_dir, single_parallel, 32.0)
    massive = fp8_error(qwen2_dir, single_parallel, 2.0**15)
    assert 0.75 * plain < llm_like < 1.25 * plain, (plain, llm_like)
    assert massive > 1.5 * plain, (plain, massive)


def test_nvfp4_feels_llm_sized_outliers(qwen2_dir, single_parallel):
    """E2M1 spans 0.5 .. 6 (12x): a 32x outlier in a 16-wide block rounds its neighbours to zero.
    Measured (docs/fp8.md): 0.262 plain, 0.706 at s=32."""
    plain = fp8_error(qwen2_dir, single_parallel, 1.0, "nvfp4")
    llm_like = fp8_error(qwen2_dir, single_parallel, 32.0, "nvfp4")
    assert llm_like > 1.8 * plain, (plain, llm_like)


if __name__ == "__main__":
    import tempfile

    from megatron_rl.actor.parallel import destroy_parallel, init_parallel
    from megatron_rl.models.tiny import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_hf_model("qwen2", tmp)
        par = init_parallel(1, 1, seed=0)
        for recipe in ("tensorwise", "blockwise", "nvfp4", "mxfp4"):
            for s in (1, 32, 1024, 8192, 2**15, 2**17):
                print(f"{recipe} mean |dlogp|, k={K} s={s}: {fp8_error(tmp, par, float(s), recipe):.4f}")
        destroy_parallel()
