"""Rollout W8A8: blockwise / tensorwise weight quantization, the W8A8Linear GEMM, model swap."""

import pytest
import torch
from torch import nn

from megatron_rl.fp8.w8a8 import (
    W8A8Linear,
    quantize_model_w8a8,
    quantize_weight_blockwise,
    quantize_weight_tensorwise,
)

E4M3 = torch.float8_e4m3fn


def ref_w8a8_blockwise(x, w_fp8, w_scale_inv, bo, bi, bias=None):
    """Slow reference: per token, per 1 x bi activation group, per (bo x bi) weight tile."""
    tokens = x.reshape(-1, x.shape[-1]).float()
    out = torch.zeros(tokens.shape[0], w_fp8.shape[0], dtype=torch.float64)
    for t in range(tokens.shape[0]):
        for j in range(0, tokens.shape[1], bi):
            group = tokens[t, j : j + bi]
            amax = group.abs().max()
            a_scale = torch.tensor(1.0) if amax == 0 else torch.tensor(448.0) / amax
            a_q = (group * a_scale).to(E4M3).double() / a_scale.double()
            for i in range(0, w_fp8.shape[0], bo):
                w_tile = w_fp8[i : i + bo, j : j + bi].double() * w_scale_inv[i // bo, j // bi]
                out[t, i : i + bo] += w_tile @ a_q.double()
    if bias is not None:
        out += bias.double()
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])


def test_blockwise_weight_scales_hand_computed():
    w = torch.zeros(130, 260)
    w[0, 0] = 896.0  # tile (0, 0): scale_inv 896 / 448 = 2
    w[129, 259] = -0.875  # tile (1, 2): scale 512, scale_inv 2^-9
    q, s = quantize_weight_blockwise(w, (128, 128))
    assert q.dtype == E4M3 and q.shape == (130, 260)
    assert s.dtype == torch.float32 and s.shape == (2, 3)
    assert s[0, 0].item() == 2.0 and s[1, 2].item() == 2.0**-9
    assert s[0, 1].item() == 1.0 and s[1, 0].item() == 1.0  # all-zero tiles
    assert q[0, 0].item() == 448.0 and q[129, 259].item() == -448.0


def test_ue8m0_scales_are_powers_of_two_covering_amax():
    torch.manual_seed(0)
    w = torch.randn(256, 384) * 0.02
    q, s = quantize_weight_blockwise(w, (128, 128), scale_format="ue8m0")
    mantissa, _ = torch.frexp(s)
    assert torch.all(mantissa == 0.5)
    tile_amax = w.reshape(2, 128, 3, 128).abs().amax(dim=(1, 3))
    assert torch.all(s * 448.0 >= tile_amax) and torch.all(s * 224.0 < tile_amax)
    assert q.float().abs().max() <= 448.0


def test_w8a8_linear_matches_slow_reference_with_partial_blocks():
    torch.manual_seed(0)
    linear = nn.Linear(80, 72, bias=True)
    nn.init.normal_(linear.bias)
    layer = W8A8Linear.from_linear(linear, block_size=(32, 32))
    assert layer.weight_scale_inv.shape == (3, 3)
    x = torch.randn(2, 3, 80)
    got = layer(x)
    ref = ref_w8a8_blockwise(x, layer.weight, layer.weight_scale_inv, 32, 32, linear.bias.detach())
    assert got.dtype == torch.float32 and got.shape == (2, 3, 72)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # and it is an approximation of the BF16 layer, with FP8-sized error
    exact = linear(x)
    rel = (got - exact).norm() / exact.norm()
    assert 1e-4 < rel.item() < 0.06


def test_load_fp8_equals_load_bf16_and_state_dict_names():
    torch.manual_seed(1)
    w = torch.randn(64, 96)
    a = W8A8Linear(96, 64, bias=False, block_size=(32, 32), dtype=torch.float32)
    a.load_bf16(w)
    wq, ws = quantize_weight_blockwise(w, (32, 32))
    b = W8A8Linear.from_quantized(wq, ws, block_size=(32, 32), dtype=torch.float32)
    x = torch.randn(5, 96)
    assert torch.equal(a(x), b(x))
    assert set(a.state_dict()) == {"weight", "weight_scale_inv"}
    assert a.state_dict()["weight"].dtype == E4M3
    # load_state_dict refreshes the cached dequantized weight
    c = W8A8Linear(96, 64, bias=False, block_size=(32, 32), dtype=torch.float32)
    c(x)
    c.load_state_dict(a.state_dict())
    assert torch.equal(c(x), a(x))


def test_bad_shapes_and_options_raise():
    layer = W8A8Linear(96, 64, block_size=(32, 32))
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        layer.load_fp8(torch.zeros(64, 96, dtype=E4M3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="weight"):
        layer.load_fp8(torch.zeros(64, 95, dtype=E4M3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="scale_format"):
        quantize_weight_blockwise(torch.ones(4, 4), scale_format="e8m0")
    with pytest.raises(ValueError, match="mode"):
        W8A8Linear(4, 4, mode="rowwise")


def test_model_to_dtype_keeps_fp8_weight_and_fp32_scales():
    layer = W8A8Linear.from_linear(nn.Linear(64, 32), block_size=(32, 32))
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == E4M3 and layer.weight_scale_inv.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16
    assert layer(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_tensorwise_dynamic_and_static_input_scale():
    torch.manual_seed(2)
    linear = nn.Linear(48, 16, bias=False)
    layer = W8A8Linear.from_linear(linear, mode="tensorwise")
    wq, ws = quantize_weight_tensorwise(linear.weight.detach())
    assert ws.shape == () and torch.equal(layer.weight.float(), wq.float())
    x = torch.randn(4, 48)
    # dynamic: one activation scale from the current amax
    a_scale = 448.0 / x.abs().max()
    x_dq = (x * a_scale).to(E4M3).float() / a_scale
    ref = x_dq.double() @ (wq.double() * ws.double()).t()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
    # static input_scale (dequant multiplier) 2^-6: values beyond 448 * 2^-6 = 7 saturate
    layer.set_input_scale(torch.tensor(2.0**-6))
    big = torch.zeros(1, 48)
    big[0, 0] = 100.0
    expected = 7.0 * (wq[:, 0].double() * ws.double())
    torch.testing.assert_close(layer(big)[0].double(), expected, rtol=1e-6, atol=1e-6)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def test_quantize_model_swaps_linears_but_not_high_precision_tensors():
    model = _tiny_llama()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    quantize_model_w8a8(model, block_size=(32, 32))
    swapped = {n for n, m in model.named_modules() if isinstance(m, W8A8Linear)}
    per_layer = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert swapped == {f"model.layers.{i}.{p}" for i in range(2) for p in per_layer}
    assert type(model.lm_head) is nn.Linear
    state = model.state_dict()
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == E4M3
    assert state["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    assert state["model.embed_tokens.weight"].dtype == torch.float32
    with torch.no_grad():
        got = model(ids).logits
    diff = (got.log_softmax(-1) - ref.log_softmax(-1)).abs()
    assert 0 < diff.max().item() < 0.1


def test_skip_by_substrings_and_predicate():
    model = _tiny_llama()
    quantize_model_w8a8(model, block_size=(32, 32), skip=["mlp", "lm_head"])
    assert not any(isinstance(m, W8A8Linear) for n, m in model.named_modules() if "mlp" in n)
    assert isinstance(model.model.layers[0].self_attn.q_proj, W8A8Linear)
    model = _tiny_llama()
    quantize_model_w8a8(model, skip=lambda name, mod: True)
    assert not any(isinstance(m, W8A8Linear) for m in model.modules())
