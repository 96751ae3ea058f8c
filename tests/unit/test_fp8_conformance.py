"""Scale arithmetic at the edges, as Transformer Engine 2.20.0.dev0 (commit d0067d0d) computes it:
block-scale overflow substitute, E8M0 byte 0, delayed scale with a margin. Expected values are
worked out by hand below (float64 arithmetic rounded once to float32)."""

import numpy as np
import torch

from megatron_rl.fp8 import dequantize, quantize
from megatron_rl.fp8.formats import E4M3
from megatron_rl.fp8.scales import delayed_scale_update, e8m0_quant_scale

BF16_MAX = 3.3895313892515355e38  # (2 - 2^-7) * 2^127
FP32_MAX = 3.4028234663852886e38


def _f32(value: float) -> float:
    return float(np.float32(value))


def test_block_scale_overflow_takes_the_input_dtype_max():
    # A 1x128 block whose amax is so small that 448 / amax overflows fp32.
    x = torch.zeros(1, 256)
    x[0, :128] = 1e-38
    x[0, 128:] = 1.0
    _, s32 = quantize(x, "block1x128", E4M3)
    _, s16 = quantize(x.to(torch.bfloat16), "block1x128", E4M3)
    assert s32[0, 0].item() == _f32(1 / FP32_MAX)  # fp32 input: FLT_MAX
    assert s16[0, 0].item() == _f32(1 / BF16_MAX)  # bf16 input: the bf16 max (recipe_common.cuh)
    assert s16[0, 1].item() == _f32(1 / _f32(448 / 1.0))
    _, tile16 = quantize(x.to(torch.bfloat16).expand(128, 256).contiguous(), "block128x128", E4M3)
    assert tile16[0, 0].item() == _f32(1 / BF16_MAX)
    # per-tensor current scaling keeps FLT_MAX whatever the input (current_scaling.cu:274)
    _, t16 = quantize(x[:, :128].to(torch.bfloat16), "tensorwise", E4M3)
    assert t16.item() == _f32(1 / FP32_MAX)


def test_e8m0_byte_zero_scales_up_instead_of_flushing():
    assert e8m0_quant_scale(torch.tensor([0], dtype=torch.uint8)).item() == 2.0**127
    assert e8m0_quant_scale(torch.tensor([254], dtype=torch.uint8)).item() == 2.0**-127
    assert e8m0_quant_scale(torch.tensor([127], dtype=torch.uint8)).item() == 1.0
    assert torch.isnan(e8m0_quant_scale(torch.tensor([255], dtype=torch.uint8))).all()
    # A 1x32 block with amax 2^-130: amax / 448 < 2^-127, so its byte is 0 and the values are
    # multiplied by 2^127: 2^-130 -> 2^-3 and -2^-131 -> -2^-4, both exact in E4M3 (TE < 2.13
    # multiplied by 1 and flushed them to 0).
    x = torch.zeros(1, 32)
    x[0, 0] = 2.0**-130
    x[0, 1] = -(2.0**-131)
    q, s = quantize(x, "mxfp8", E4M3)
    assert s.view(torch.uint8)[0, 0].item() == 0
    assert q.float()[0, 0].item() == 2.0**-3 and q.float()[0, 1].item() == -(2.0**-4)
    back = dequantize(q, s, "mxfp8")
    assert back[0, 0].item() == 2.0**-130 and back[0, 1].item() == -(2.0**-131)


def test_delayed_scale_is_one_division_by_amax():
    history = torch.tensor([[1e-30]])
    scale = torch.ones(1)
    delayed_scale_update(history, scale, 448.0, margin=130, amax_compute_algo="max")
    # (448 * 2^-130) / 1e-30 = 3.29e-7; dividing by 2^130 after 448 / 1e-30 would give 0.
    assert scale.item() == _f32(_f32(448 * 2.0**-130) / _f32(1e-30))
    history = torch.tensor([[1e-39]])
    delayed_scale_update(history, scale, 448.0, margin=0, amax_compute_algo="max")
    assert scale.item() == _f32(FP32_MAX)  # 448 / 1e-39 overflows: FLT_MAX
    history = torch.tensor([[2.0], [8.0]])
    delayed_scale_update(history, scale, 448.0, margin=1, amax_compute_algo="max")
    assert scale.item() == 28.0  # (448 / 2) / 8
