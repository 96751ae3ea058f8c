"""Emulated FP8 linear vs a plain reference (forward and backward), shadow switch, delayed state."""

import threading

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.fp8 import Fp8Recipe, dequantize, fp8_disabled, fp8_enabled, quantize
from megatron_rl.fp8.linear import Fp8Linear, Fp8Plan, fp8_linear

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ["tensorwise", "rowwise", "blockwise", "mxfp8", "delayed"]

# Written out by hand from TE's recipes (not read from Fp8Recipe): (granularity, block) per role.
PER_TENSOR = {"input": ("tensorwise", None), "weight": ("tensorwise", None),
              "grad": ("tensorwise", None)}
LAYOUT = {
    "tensorwise": PER_TENSOR,
    "delayed": PER_TENSOR,
    "rowwise": {"input": ("rowwise", None), "weight": ("rowwise", None), "grad": ("rowwise", None)},
    "blockwise": {"input": ("block1x128", 32), "weight": ("block128x128", 32),
                  "grad": ("block1x128", 32)},
    "mxfp8": {"input": ("mxfp8", 32), "weight": ("mxfp8", 32), "grad": ("mxfp8", 32)},
}


def fake_quant(t, layout, dtype):
    """Quantize-dequantize along the last dim (the GEMM contraction dim)."""
    granularity, block = layout
    q, s = quantize(t, granularity, dtype, block)
    return dequantize(q, s, granularity, block)


def reference(recipe_name, fmt, x, w, b, dy):
    """Plain reference: fprop x.W^T, dgrad dy.W, wgrad dy^T.x, each operand fake-quantized
    along that GEMM's contraction dim; grads E5M2 for hybrid."""
    lay = LAYOUT[recipe_name]
    g_dtype = E5 if fmt == "hybrid" else E4
    y = fake_quant(x, lay["input"], E4) @ fake_quant(w, lay["weight"], E4).t() + b
    dx = fake_quant(dy, lay["grad"], g_dtype) @ fake_quant(w.t(), lay["weight"], E4).t()
    dw = fake_quant(dy.t(), lay["grad"], g_dtype) @ fake_quant(x.t(), lay["input"], E4).t()
    return y, dx, dw, dy.sum(0)


def run_emulated(recipe, x, w, b, dy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x, w, b, Fp8Plan(recipe))
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def make_case(m=48, k=96, n=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k)
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen)
    dy = torch.randn(m, n, generator=gen) * 1e-3
    return x, w, b, dy


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("name", RECIPES)
def test_matches_plain_reference_forward_and_backward(name, fmt):
    recipe = Fp8Recipe(name, fmt, block_size=32)
    x, w, b, dy = make_case()
    got = run_emulated(recipe, x, w, b, dy)
    want = reference(name, fmt, x, w, b, dy)
    for label, g, r in zip(("y", "dx", "dw", "db"), got, want):
        torch.testing.assert_close(g, r, rtol=2e-5, atol=1e-6, msg=label)


@pytest.mark.parametrize("name", RECIPES)
def test_close_to_high_precision_and_gradients_not_zeroed(name):
    x, w, b, dy = make_case(seed=1)
    got = run_emulated(Fp8Recipe(name, block_size=32), x, w, b, dy)
    exact = [t.clone().requires_grad_() for t in (x, w, b)]
    y = F.linear(*exact)
    y.backward(dy)
    for g, r in zip(got, (y.detach(), exact[0].grad, exact[1].grad)):
        rel = ((g - r).norm() / r.norm()).item()
        assert 1e-4 < rel < 0.15, rel  # FP8-sized: clearly not exact, clearly not garbage


def test_hybrid_quantizes_grads_in_e5m2():
    # dy amax 7: E4M3 scale 448/7 = 64, E5M2 scale 57344/7 = 8192. 1.125 * 64 = 72 is exact in
    # E4M3; 1.125 * 8192 = 1.125 * 2^13 is halfway between E5M2's 2^13 and 1.25 * 2^13 -> 2^13.
    x = torch.ones(1, 4)
    w = torch.ones(2, 4)
    dy = torch.tensor([[7.0, 1.125]])
    for fmt, expect in (("e4m3", 7.0 + 1.125), ("hybrid", 7.0 + 1.0)):
        xg = x.clone().requires_grad_()
        fp8_linear(xg, w, None, Fp8Plan(Fp8Recipe("tensorwise", fmt))).backward(dy)
        assert xg.grad.tolist() == [[expect] * 4]


def test_shadow_switch_is_bitwise_high_precision_and_nests():
    recipe = Fp8Recipe("blockwise", block_size=32)
    layer = Fp8Linear(96, 64, recipe=recipe)
    x = torch.randn(8, 96)
    with fp8_disabled():
        assert not fp8_enabled()
        with fp8_disabled():
            shadow = layer(x)
        assert not fp8_enabled()  # still inside the outer block
        shadow2 = layer(x)
    assert fp8_enabled()
    plain = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(shadow, plain) and torch.equal(shadow2, plain)
    assert not torch.equal(layer(x), plain)


def test_shadow_switch_is_thread_local():
    seen = []
    with fp8_disabled():
        t = threading.Thread(target=lambda: seen.append(fp8_enabled()))
        t.start()
        t.join()
    assert seen == [True]


def test_bf16_recipe_never_quantizes():
    layer = Fp8Linear(16, 8, recipe=Fp8Recipe("bf16"))
    x = torch.randn(3, 16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_bf16_activations_keep_dtype():
    layer = Fp8Linear(64, 32, recipe=Fp8Recipe("rowwise"), dtype=torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------ delayed scaling
def test_delayed_history_scales_by_hand():
    layer = Fp8Linear(4, 2, bias=False, recipe=Fp8Recipe("delayed", "hybrid", amax_history_len=3))
    state = layer.fp8_state
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 0.25], [0.0, 1.0, 1.0, 1.0]]))
    amaxes = [4.0, 16.0, 2.0, 1.0]
    for a in amaxes:
        x = torch.tensor([[a, 0.0, 0.0, 0.0]], requires_grad=True)
        layer(x).sum().backward()
    # TE's window (length 3) at an update: the current amax and the 2 before it -> max(16, 2, 1)
    assert state.num_updates.tolist() == [4, 4, 4]
    assert state.scale[0].item() == 448.0 / 16.0
    assert state.scale[1].item() == 448.0 / 2.0  # weight amax 2 every step
    assert state.scale[2].item() == 57344.0  # grad of sum() is ones: E5M2 max / 1
    assert state.amax_history[:, 0].tolist() == [0.0, 2.0, 1.0]  # slot 0 zeroed for the next
    layer(torch.tensor([[1.0, 0.0, 0.0, 0.0]], requires_grad=True)).sum().backward()
    assert state.scale[0].item() == 448.0 / 2.0  # 16 left the window


def test_delayed_uses_previous_scale_and_saturates_on_a_spike():
    layer = Fp8Linear(4, 1, bias=False, recipe=Fp8Recipe("delayed", amax_history_len=4))
    with torch.no_grad():
        layer.weight.fill_(1.0)
    layer(torch.full((1, 4), 1.0, requires_grad=True)).sum().backward()  # scale_x = 448
    spike = torch.tensor([[100.0, 1.0, 0.0, 0.0]], requires_grad=True)
    y = layer(spike)  # quantized with scale 448: 100 * 448 saturates to 448 -> 1.0
    assert y.item() == pytest.approx(1.0 + 1.0)
    assert layer.fp8_state.scale[0].item() == pytest.approx(448.0 / 100.0)  # updated after


def test_delayed_history_untouched_by_no_grad_eval_and_shadow():
    layer = Fp8Linear(8, 4, recipe=Fp8Recipe("delayed"))
    x = torch.randn(2, 8)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    layer.train()
    with fp8_disabled():
        layer(x).sum().backward()
    assert layer.fp8_state.num_updates.tolist() == [0, 0, 0]
    layer(x).sum().backward()
    assert layer.fp8_state.num_updates.tolist() == [1, 1, 1]


def test_delayed_state_is_checkpointable():
    recipe = Fp8Recipe("delayed", amax_history_len=8, margin=1)
    a = Fp8Linear(8, 4, recipe=recipe)
    for step in range(3):
        a(torch.randn(5, 8) * (step + 1)).sum().backward()
    state = a.state_dict()
    assert {"fp8_state.amax_history", "fp8_state.scale", "fp8_state.num_updates"} <= set(state)
    b = Fp8Linear(8, 4, recipe=recipe)
    b.load_state_dict(state)
    x = torch.randn(3, 8) * 5
    assert torch.equal(a(x), b(x))
    # margin 1 halves the scale: 448 / max(history) / 2
    expect = 448.0 / a.fp8_state.amax_history[:, 0].max().item() / 2
    assert b.fp8_state.scale[0].item() == pytest.approx(expect)


def test_delayed_most_recent():
    recipe = Fp8Recipe("delayed", amax_compute_algo="most_recent")
    layer = Fp8Linear(2, 1, bias=False, recipe=recipe)
    for a in (8.0, 2.0):
        layer(torch.tensor([[a, 0.0]], requires_grad=True)).sum().backward()
    assert layer.fp8_state.scale[0].item() == pytest.approx(448.0 / 2.0)


# ------------------------------------------------------------------ recipe
def test_recipe_from_contract_and_operands():
    r = Fp8Recipe.from_contract("blockwise", "hybrid")
    assert r.enabled and r.operand("weight").granularity == "block128x128"
    assert r.operand("weight").block_size == (128, 128)
    assert r.operand("grad_output").fp8_dtype == E5 and r.operand("input").fp8_dtype == E4
    assert Fp8Recipe.from_contract("mxfp8", "e4m3").operand("grad_output").fp8_dtype == E4
    assert not Fp8Recipe.from_contract("bf16", "hybrid").enabled
    assert Fp8Recipe.from_contract("delayed", "hybrid", margin=2).margin == 2
    for bad, key in ((("fp4", "hybrid"), "train_recipe"), (("blockwise", "e5m2"), "fp8_format")):
        with pytest.raises(ValueError, match=key):
            Fp8Recipe.from_contract(*bad)
    with pytest.raises(ValueError, match="amax_history_len"):
        Fp8Recipe.from_contract("delayed", "hybrid", amax_history_len=0)
    with pytest.raises(ValueError, match="unknown"):
        Fp8Recipe.from_contract("delayed", "hybrid", history=3)
    with pytest.raises(ValueError, match="bf16"):
        Fp8Recipe().operand("input")
