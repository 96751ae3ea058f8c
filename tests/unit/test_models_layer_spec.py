"""build_layer_spec: local spec on CPU (separate RMSNorms, QK norm for Qwen3), FP8 linears on request."""

import pytest
import torch

from megatron_rl.models.hf_config import ModelSpec
from megatron_rl.models.layer_spec import build_layer_spec, te_available
from megatron_rl.models.tiny import tiny_hf_config


def spec_of(arch: str) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_hf_config(arch))


def test_te_is_not_picked_without_cuda():
    if not torch.cuda.is_available():
        assert te_available() is False


@pytest.mark.parametrize("arch, qk_norm", [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_local_spec(arch, qk_norm):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    sub = build_layer_spec(spec_of(arch), use_te=False).submodules
    assert sub.input_layernorm is not IdentityOp and sub.pre_mlp_layernorm is not IdentityOp
    attn = sub.self_attention.submodules
    assert attn.linear_qkv is ColumnParallelLinear and attn.linear_proj is RowParallelLinear
    assert (attn.q_layernorm is not IdentityOp) == qk_norm
    assert (attn.k_layernorm is not IdentityOp) == qk_norm


def test_fp8_recipe_swaps_the_linears_only_when_enabled():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_rl.fp8 import Fp8Recipe

    plain = build_layer_spec(spec_of("qwen2"), fp8_recipe=Fp8Recipe(), use_te=False)
    assert plain.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear
    fp8 = build_layer_spec(spec_of("qwen2"), fp8_recipe=Fp8Recipe("tensorwise"), use_te=False)
    from megatron_rl.models.fp8_layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    assert fp8.submodules.self_attention.submodules.linear_qkv.module is Fp8ColumnParallelLinear
    assert fp8.submodules.mlp.submodules.linear_fc2.module is Fp8RowParallelLinear
