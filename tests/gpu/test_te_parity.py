"""The emulation against Transformer Engine's own kernels (skipped without CUDA and TE).

Quantizers: bitwise-equal FP8 bytes and equal dequantized values for current (tensorwise),
delayed (given scale), blockwise 1x128 / 128x128 (FP32 and power-of-two scales) and MXFP8.
Linear layers: te.Linear under the recipe from build_te_recipe vs the emulated fp8_linear on the
same weights: far closer to each other than either is to BF16 (GEMM accumulation differs).
"""

import pytest
import torch

from megatron_rl.fp8 import Fp8Recipe, dequantize, quantize
from megatron_rl.fp8.linear import Fp8Plan, fp8_linear
from megatron_rl.fp8.te_recipe import build_te_recipe, te_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_available(), reason="needs CUDA and transformer_engine"),
]

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(256, 512), (200, 328)]  # the second has partial 128-blocks


@pytest.fixture(scope="module")
def te():
    import transformer_engine.pytorch as te_pytorch
    import transformer_engine_torch as tex

    return te_pytorch, tex


def _te_class(te_pytorch, name: str, module: str):
    """A quantizer class from the top-level export (TE >= 2.8) or its tensor module."""
    if hasattr(te_pytorch, name):
        return getattr(te_pytorch, name)
    import importlib

    return getattr(importlib.import_module(f"transformer_engine.pytorch.tensor.{module}"), name)


def _available(te_pytorch, what: str) -> bool:
    check = getattr(te_pytorch, f"is_{what}_available", None)
    if check is None:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

        check = getattr(FP8GlobalStateManager, f"is_{what}_available")
    result = check()
    return result[0] if isinstance(result, tuple) else bool(result)


def _te_dtype(tex, dtype):
    return tex.DType.kFloat8E4M3 if dtype == E4 else tex.DType.kFloat8E5M2


# Magnitude ranges (log10) across the columns: ordinary values, and tiny amaxes where a block
# scale overflows fp32 (the input dtype's max substitutes) and MXFP8 blocks get E8M0 byte 0.
RANGES = [(-2, 2), (-40, -30)]


def _sample(shape, seed=0, decades=(-2, 2)):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=gen, device="cuda") * torch.logspace(
        *decades, shape[-1], device="cuda")
    x[:, :7] = 0.0  # a few zero entries; zero blocks below
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("decades", RANGES)
def test_current_scaling_bitwise(te, shape, dtype, decades):
    te_pytorch, tex = te
    cls = _te_class(te_pytorch, "Float8CurrentScalingQuantizer", "float8_tensor")
    x = _sample(shape, decades=decades)
    qt = cls(_te_dtype(tex, dtype), device=torch.device("cuda"))(x)
    q, s = quantize(x, "tensorwise", dtype)
    assert torch.equal(qt._data.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qt._scale_inv.reshape(()), s)


def test_delayed_scaling_cast_with_given_scale_bitwise(te):
    te_pytorch, tex = te
    cls = _te_class(te_pytorch, "Float8Quantizer", "float8_tensor")
    x = _sample((256, 512))
    scale = torch.tensor([3.0], device="cuda")  # saturates the largest entries
    quantizer = cls(scale=scale.clone(), amax=torch.zeros(1, device="cuda"),
                    fp8_dtype=tex.DType.kFloat8E4M3)
    qt = quantizer(x)
    q, _ = quantize(x, "tensorwise", E4, scale=scale[0])
    assert torch.equal(qt._data.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("decades", RANGES)
def test_blockwise_bitwise(te, shape, dim, pow2, decades):
    te_pytorch, tex = te
    if not _available(te_pytorch, "fp8_block_scaling"):
        pytest.skip("FP8 block scaling not supported on this GPU")
    cls = _te_class(te_pytorch, "Float8BlockQuantizer", "float8_blockwise_tensor")
    x = _sample(shape, decades=decades)
    x[:128, :128] = 0.0  # an all-zero block / tile
    quantizer = cls(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                    amax_epsilon=0.0, force_pow_2_scales=pow2, block_scaling_dim=dim)
    qt = quantizer(x)
    granularity = "block1x128" if dim == 1 else "block128x128"
    q, s = quantize(x, granularity, E4, power_2_scale=pow2)
    assert torch.equal(qt._rowwise_data.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qt.dequantize(dtype=torch.float32), dequantize(q, s, granularity))


@pytest.mark.parametrize("decades", RANGES)
def test_mxfp8_bitwise(te, decades):
    te_pytorch, tex = te
    if not _available(te_pytorch, "mxfp8"):
        pytest.skip("MXFP8 not supported on this GPU")
    cls = _te_class(te_pytorch, "MXFP8Quantizer", "mxfp8_tensor")
    x = _sample((256, 512), decades=decades)
    qt = cls(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)(x)
    q, s = quantize(x, "mxfp8", E4)
    assert torch.equal(qt._rowwise_data.view(torch.uint8), q.view(torch.uint8))
    te_scales = qt._rowwise_scale_inv.view(torch.uint8)[: s.shape[0], : s.shape[1]]
    assert torch.equal(te_scales, s.view(torch.uint8))


@pytest.mark.parametrize("name", ["tensorwise", "blockwise", "mxfp8"])
def test_te_linear_close_to_emulated_linear(te, name):
    te_pytorch, _ = te
    needs = {"blockwise": "fp8_block_scaling", "mxfp8": "mxfp8", "tensorwise": "fp8"}[name]
    if not _available(te_pytorch, needs):
        pytest.skip(f"{name} not supported on this GPU")
    recipe = Fp8Recipe(name, "hybrid")
    torch.manual_seed(0)
    layer = te_pytorch.Linear(512, 384, bias=True, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        xi = x.clone().requires_grad_()
        layer.weight.grad = None
        y = fn(xi)
        y.backward(dy)
        return [y.float(), xi.grad.float(), layer.weight.grad.float()]

    autocast = getattr(te_pytorch, "fp8_autocast")
    with autocast(enabled=True, fp8_recipe=build_te_recipe(recipe)):
        got_te = run(layer)
    got_emu = run(lambda xi: fp8_linear(xi, layer.weight, layer.bias, Fp8Plan(recipe)))
    got_bf16 = run(lambda xi: torch.nn.functional.linear(xi, layer.weight, layer.bias))
    for t, e, b in zip(got_te, got_emu, got_bf16):
        emu_err = ((t - e).norm() / t.norm()).item()
        fp8_err = ((t - b).norm() / t.norm()).item()
        assert emu_err < 0.25 * fp8_err, (name, emu_err, fp8_err)
