"""Megatron FP8 parallel linears at TP=1 and the layer-spec swap."""

import pytest
import torch

from megatron_rl.fp8 import Fp8Recipe, fp8_disabled
from megatron_rl.fp8.linear import Fp8Linear


@pytest.fixture(scope="module")
def mp_config(single_parallel):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(use_cpu_initialization=True, perform_initialization=True,
                               params_dtype=torch.float32, gradient_accumulation_fusion=False)


def build_pair(mp_config, recipe, bias=True):
    """An Fp8ColumnParallelLinear and an Fp8Linear holding the same weights."""
    from megatron_rl.models.fp8_layers import Fp8ColumnParallelLinear

    torch.manual_seed(0)
    layer = Fp8ColumnParallelLinear(96, 64, config=mp_config, init_method=torch.nn.init.normal_,
                                    bias=bias, gather_output=False, fp8_recipe=recipe)
    plain = Fp8Linear(96, 64, bias=bias, recipe=recipe)
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
        if bias:
            layer.bias.normal_()
            plain.bias.copy_(layer.bias)
    return layer, plain


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mxfp8", "delayed", "nvfp4",
                                  "mxfp4"])
def test_column_parallel_matches_emulated_linear_at_tp1(mp_config, name):
    recipe = Fp8Recipe(name, block_size=32)
    layer, plain = build_pair(mp_config, recipe)
    x = torch.randn(5, 2, 96)  # [seq, batch, hidden]
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, _ = layer(xa)
    yb = plain(xb)
    assert torch.equal(ya, yb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(layer.weight.grad, plain.weight.grad)
    assert torch.equal(layer.bias.grad, plain.bias.grad)


def test_shadow_is_bitwise_the_megatron_parent(mp_config):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer, _ = build_pair(mp_config, Fp8Recipe("blockwise", block_size=32))
    parent = ColumnParallelLinear(96, 64, config=mp_config, init_method=torch.nn.init.normal_,
                                  bias=True, gather_output=False)
    parent.load_state_dict(layer.state_dict())
    x = torch.randn(4, 3, 96)
    with fp8_disabled():
        shadow, _ = layer(x)
    assert torch.equal(shadow, parent(x)[0])
    assert not torch.equal(layer(x)[0], shadow)


def test_row_parallel_keeps_bias_after_gemm(mp_config):
    from megatron_rl.models.fp8_layers import Fp8RowParallelLinear

    recipe = Fp8Recipe("rowwise")
    layer = Fp8RowParallelLinear(64, 32, config=mp_config, init_method=torch.nn.init.normal_,
                                 bias=True, input_is_parallel=True, skip_bias_add=False,
                                 fp8_recipe=recipe)
    with torch.no_grad():
        layer.bias.fill_(0.5)
    plain = Fp8Linear(64, 32, recipe=recipe)
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
        plain.bias.fill_(0.5)
    x = torch.randn(3, 2, 64)
    torch.testing.assert_close(layer(x)[0], plain(x), rtol=0, atol=1e-6)


def test_delayed_state_in_state_dicts(mp_config):
    layer, _ = build_pair(mp_config, Fp8Recipe("delayed", amax_history_len=4))
    layer(torch.randn(2, 2, 96, requires_grad=True))[0].sum().backward()
    assert layer.fp8_state.num_updates.tolist() == [1, 1, 1]
    assert "fp8_state.amax_history" in layer.state_dict()
    sharded = layer.sharded_state_dict(prefix="l.", metadata={"dp_cp_group": None})
    keys = {"l.fp8_state.amax_history", "l.fp8_state.scale", "l.fp8_state.num_updates"}
    assert keys <= set(sharded)


def test_apply_fp8_to_layer_spec_swaps_the_four_linears_only():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_rl.models.fp8_layers import (
        Fp8ColumnParallelLinear,
        Fp8RowParallelLinear,
        apply_fp8_to_layer_spec,
    )

    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    recipe = Fp8Recipe("blockwise")
    spec = apply_fp8_to_layer_spec(base, recipe)
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    for sub, name, cls in ((attn, "linear_qkv", Fp8ColumnParallelLinear),
                           (attn, "linear_proj", Fp8RowParallelLinear),
                           (mlp, "linear_fc1", Fp8ColumnParallelLinear),
                           (mlp, "linear_fc2", Fp8RowParallelLinear)):
        built = getattr(sub, name)
        assert built.module is cls and built.params["fp8_recipe"] is recipe
    assert spec.submodules.input_layernorm is base.submodules.input_layernorm
    assert base.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear  # untouched
    bf16 = apply_fp8_to_layer_spec(base, Fp8Recipe("bf16"))
    assert bf16.submodules.mlp.submodules.linear_fc1 is ColumnParallelLinear
    with pytest.raises(ValueError, match="Fp8Recipe"):
        apply_fp8_to_layer_spec(base, "blockwise")
    broken = apply_fp8_to_layer_spec(base, Fp8Recipe("bf16"))
    broken.submodules.mlp.submodules.linear_fc1 = torch.nn.Linear
    with pytest.raises(ValueError, match="linear_fc1"):
        apply_fp8_to_layer_spec(broken, recipe)
