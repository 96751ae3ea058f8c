"""Activation recompute (selective, full uniform, full block) == no recompute, FP8 recipes
included: loss, grad norm and gradients bitwise, delayed-scaling histories recorded once."""

import dataclasses

import pytest
import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.settings import plain_settings
from megatron_rl.fp8 import Fp8Recipe
from test_actor_train import make_batch, pg_loss

MODES = {"selective": ("selective", "uniform", 1), "full_uniform": ("full", "uniform", 1),
         "full_block": ("full", "block", 1)}


def run(hf_dir, parallel, recipe: str, mode: str | None) -> dict:
    settings = plain_settings()
    if mode is not None:
        granularity, method, num_layers = MODES[mode]
        settings = dataclasses.replace(settings, recompute_granularity=granularity,
                                       recompute_method=method, recompute_num_layers=num_layers)
    actor = MegatronActor.build(hf_dir, parallel=parallel, lr=1e-3, clip_grad=0.0,
                                fp8_recipe=Fp8Recipe(recipe, block_size=32), settings=settings)
    steps = []
    for seed in (0, 1):  # two steps: the second quantizes with the first's delayed history
        batch = make_batch(seed)
        out = actor.train_step(batch, pg_loss(float(batch["loss_mask"].sum())), micro_batch_size=2)
        steps.append((out["loss"], out["grad_norm"]))
    grads = {n: p.main_grad.clone() for n, p in actor._params.items()}
    buffers = {n: b.clone() for n, b in actor.model[0].named_buffers() if "fp8_state" in n}
    return {"steps": steps, "grads": grads, "buffers": buffers}


@pytest.mark.parametrize("recipe", ["bf16", "delayed", "tensorwise", "blockwise"])
def test_recompute_matches_no_recompute(recipe, qwen2_dir, single_parallel):
    ref = run(qwen2_dir, single_parallel, recipe, None)
    assert (len(ref["buffers"]) > 0) == (recipe == "delayed")
    for mode in MODES:
        got = run(qwen2_dir, single_parallel, recipe, mode)
        assert got["steps"] == ref["steps"], mode
        for name, grad in ref["grads"].items():
            assert torch.equal(got["grads"][name], grad), (mode, name)
        for name, buf in ref["buffers"].items():  # amax histories, scales, update counts
            assert torch.equal(got["buffers"][name], buf), (mode, name)


def test_delayed_recompute_replays_scales_across_interleaved_forwards(single_parallel):
    """Pipeline warm-up order: forward A, forward B, then backward A, backward B. The recompute of
    B must quantize with the scale B's forward used, not one updated by A's recompute."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.random import checkpoint

    from megatron_rl.models.fp8_layers import Fp8ColumnParallelLinear

    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32,
                                 gradient_accumulation_fusion=False)

    def make():
        torch.manual_seed(0)
        return Fp8ColumnParallelLinear(64, 32, config=config, init_method=torch.nn.init.normal_,
                                       bias=False, gather_output=False,
                                       fp8_recipe=Fp8Recipe("delayed", amax_history_len=4))

    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(6, 2, 64, generator=gen) * s for s in (1.0, 30.0)]  # different amaxes
    dys = [torch.randn(6, 2, 32, generator=gen) for _ in xs]

    def interleaved(layer, recompute: bool):
        ins = [x.clone().requires_grad_() for x in xs]
        fwd = (lambda t: checkpoint(lambda u: layer(u)[0], False, t)) if recompute else \
            (lambda t: layer(t)[0])
        outs = [fwd(t) for t in ins]
        for out, dy in zip(outs, dys):
            out.backward(dy)
        return [o.detach() for o in outs], [t.grad for t in ins], layer

    ref_out, ref_grads, ref_layer = interleaved(make(), False)
    out, grads, layer = interleaved(make(), True)
    for a, b in zip(out + grads, ref_out + ref_grads):
        assert torch.equal(a, b)
    assert torch.equal(layer.weight.grad, ref_layer.weight.grad)
    for name, buf in ref_layer.fp8_state.named_buffers():
        assert torch.equal(getattr(layer.fp8_state, name), buf), name
    assert int(layer.fp8_state.num_updates[0]) == 2  # input amax recorded once per forward


def test_full_recompute_of_more_layers_than_the_stage_has_is_refused(qwen2_dir, single_parallel):
    settings = dataclasses.replace(plain_settings(), recompute_granularity="full",
                                   recompute_method="block", recompute_num_layers=3)
    with pytest.raises(ValueError, match=r"parallel\.recompute_num_layers.*3 > 2"):
        MegatronActor.build(qwen2_dir, parallel=single_parallel, settings=settings)
