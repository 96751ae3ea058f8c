"""TorchRolloutEngine with rollout_quant nvfp4 / mxfp4 (W4A4): quantized weights vs the slow
references of test_fp4.py, generation, weight sync in high precision, refused FP8 payloads."""

import math

import pytest
import torch
from torch import nn

from megatron_rl.config import load_config
from megatron_rl.fp8.w4a4 import W4A4Linear, fake_quantize_activation
from megatron_rl.rollout import SamplingParams, TorchRolloutEngine
from megatron_rl.rollout.sglang_checkpoint import rollout_quant_spec
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout
from tests.unit.test_fp4 import ref_mxfp4, ref_nvfp4
from tests.unit.test_rollout_fp8_engine import LINEARS, PROMPTS, tiny_model

MODES = ("nvfp4", "mxfp4")


def fp4_engine(mode, model=None, **kw):
    return TorchRolloutEngine(model if model is not None else tiny_model(), rollout_quant=mode, **kw)


def run(engine):
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=7, seed=5, n=2))


def reference_dequantized(mode, w):
    return ref_nvfp4(w, rows=1)[2] if mode == "nvfp4" else ref_mxfp4(w)[2]


@pytest.mark.parametrize("mode", MODES)
def test_linears_hold_fp4_weights_equal_to_the_reference(mode):
    engine = fp4_engine(mode)
    layers = {n: m for n, m in engine.model.named_modules() if isinstance(m, W4A4Linear)}
    assert len(layers) == 2 * len(LINEARS)  # lm_head is tied: stays high precision
    original = tiny_model()
    name = "model.layers.1.mlp.down_proj"
    w = original.get_submodule(name).weight.detach()
    held = layers[name]
    assert held.weight.dtype == torch.uint8 and int(held.weight.max()) < 16
    block = 16 if mode == "nvfp4" else 32
    assert held.weight_scale.shape == (64, math.ceil(128 / block))
    assert torch.equal(held.dequantized_weight(), reference_dequantized(mode, w))


@pytest.mark.parametrize("mode", MODES)
def test_w4a4_forward_is_fake_quantized_activations_times_weights(mode):
    layer = W4A4Linear.from_linear(nn.Linear(64, 32), mode=mode)
    x = torch.randn(3, 5, 64)
    expected = reference_dequantized(mode, x.reshape(15, 64)).reshape(3, 5, 64) @ layer.dequantized_weight().t()
    torch.testing.assert_close(layer(x), expected + layer.bias.float(), rtol=1e-6, atol=1e-6)
    if mode == "nvfp4":
        # One global scale per activation tensor, so a row depends on its batch. Alone, the block
        # [5, 0, ...] has global amax 5: scale e4m3(5 * (2688 / 5) / 6) = 448, 5 -> 6 -> 6 * 448 *
        # 5 / 2688 = 5. Next to a row of amax 6: scale e4m3(5 * 448 / 6 = 373.3) = 384, and
        # 5 * 448 / 384 = 5.83 -> 6 -> 6 * 384 * 6 / 2688 = 36 / 7.
        pair = torch.zeros(2, 16)
        pair[0, 0], pair[1, 0] = 5.0, 6.0
        assert fake_quantize_activation(pair[:1], mode)[0, 0].item() == 5.0
        torch.testing.assert_close(fake_quantize_activation(pair, mode)[0, 0], torch.tensor(36 / 7))


@pytest.mark.parametrize("mode", MODES)
def test_w4a4_engine_generates_and_differs_from_bf16(mode):
    samples = run(fp4_engine(mode))
    plain = run(TorchRolloutEngine(tiny_model()))
    assert len(samples) == 2 * len(PROMPTS)
    assert all(math.isfinite(lp) for s in samples for lp in s.rollout_logprobs)
    assert [s.rollout_logprobs for s in samples] != [s.rollout_logprobs for s in plain]
    fp8 = run(TorchRolloutEngine(tiny_model(), rollout_quant="fp8_blockwise", weight_block_size=(32, 32)))
    first = lambda out: [s.rollout_logprobs[0] for s in out]  # noqa: E731  same prompt: same first token
    err_fp4 = sum(abs(a - b) for a, b in zip(first(samples), first(plain)))
    err_fp8 = sum(abs(a - b) for a, b in zip(first(fp8), first(plain)))
    assert err_fp4 > err_fp8


@pytest.mark.parametrize("mode", MODES)
def test_sync_ships_high_precision_and_the_engine_quantizes(mode):
    spec = RolloutQuantSpec(mode)
    weights = tiny_model(seed=11).state_dict()
    payload = list(quantize_for_rollout(weights.items(), spec))
    assert [n for n, _ in payload] == list(weights) and all(t.dtype == torch.float32 for _, t in payload)
    engine = fp4_engine(mode)
    before = run(engine)
    engine.update_weights(payload, version=1)
    engine.finish_update(1)
    assert run(engine) == run(fp4_engine(mode, tiny_model(seed=11))) != before
    engine.release_memory()
    engine.resume_memory()
    engine.update_weights(payload, version=2)
    engine.finish_update(2)  # weight, weight_scale (and weight_amax) all count as re-sent
    assert run(engine) == run(fp4_engine(mode, tiny_model(seed=11)))


def test_fp8_payload_is_refused_by_a_w4a4_engine():
    engine = fp4_engine("nvfp4")
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=f"'{name}'.*rollout_quant='nvfp4' takes high-precision"):
        engine.update_weights([(name, torch.zeros(64, 64).to(torch.float8_e4m3fn))], version=1)


def test_rollout_quant_spec_carries_fp4_for_torch_and_refuses_sglang():
    cfg = load_config(None, ["precision.rollout_quant=nvfp4"])
    assert rollout_quant_spec(cfg).rollout_quant == "nvfp4"
    cfg.rollout.engine = "sglang"  # past validation, which refuses this combination already
    with pytest.raises(ValueError, match="precision.rollout_quant.*torch rollout engine only"):
        rollout_quant_spec(cfg)
