"""Scale arithmetic of every recipe: amax -> scale, power-of-two rounding, E8M0, delayed update.

Conventions (identical to Transformer Engine's kernels, so emulated and TE quantized bytes match;
followed: TE 2.20.0.dev0, commit d0067d0d, which includes the >= 2.13 E8M0 change below):
- `scale` multiplies the high-precision value before the cast: q = sat_cast(x_fp32 * scale).
- `scale_inv` = 1 / scale multiplies q to dequantize. It is what HF FP8 checkpoints call
  `weight_scale_inv` (= amax / 448 up to one ulp: TE and we compute 1 / (448 / amax)).
- amax == 0 (an all-zero tensor or block) or amax = inf gives scale = scale_inv = 1; a NaN scale
  becomes 1; a scale that overflows fp32 (tiny amax) becomes `value_for_inf`: the largest fp32
  for per-tensor current and delayed scaling (current_scaling.cu:274, delayed_scaling.cu:149),
  the largest value of the INPUT dtype for block scales (recipe_common.cuh:62-68,
  compute_scale_from_types: 3.39e38 for bf16 input).
- E8M0 (MXFP8): the multiplier of byte b is 2^(127 - b) for every b < 255, byte 0 included
  (2^127; ptx.cuh exp2f_rcp, TE >= 2.13, PR #2647): a block of tiny values is scaled up and
  kept, not flushed to zero. Byte 255 is NaN.
- Delayed scaling: scale = (fp8_max * 2^-margin) / amax, one division (delayed_scaling.cu:300,
  140), so a large margin cannot overflow an intermediate fp8_max / amax.
"""

import torch

FP32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(
    amax: torch.Tensor, fp8_max: float, power_2_scale: bool = False,
    value_for_inf: float = FP32_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantization scale and its inverse from an amax, exactly as TE's compute_scale_from_amax.

    Args:
        amax: float32 tensor of any shape (one entry per scaling group), >= 0.
        fp8_max: 448.0 (E4M3) or 57344.0 (E5M2).
        power_2_scale: round the scale down to a power of two (TE's QParams.power_2_scale;
            mantissa bits cleared), so scale_inv is a power of two that never under-covers amax.
        value_for_inf: the scale where fp8_max / amax overflows fp32 (see the module docstring).
    Returns:
        (scale, scale_inv), float32, shape of `amax`.
    """
    amax = amax.float()
    # torch.div, not `fp8_max / amax`: Tensor.__rtruediv__ computes reciprocal(amax) * fp8_max,
    # two roundings; TE uses one correctly rounded fp32 division (__fdiv_rn).
    scale = torch.div(torch.full_like(amax, fp8_max), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if power_2_scale:
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    unit = (amax == 0) | torch.isinf(amax) | torch.isnan(scale)
    scale = torch.where(unit, torch.ones_like(scale), scale)
    return scale, torch.reciprocal(scale)


def e8m0_from_amax(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """MXFP8 block scale: the E8M0 byte of amax / fp8_max rounded up to a power of two.

    Mirrors TE's `float_to_e8m0(amax * max_norm_rcp)`: the division is a multiplication by the
    float32 reciprocal of fp8_max; the exponent is rounded toward +inf when mantissa bits are
    set (so the block max never saturates), saturates at 254 (2^127), maps 0 and values
    <= 2^-127 to byte 0 (2^-127) and NaN to 255.

    Args:
        amax: float32 tensor, >= 0 (one entry per 1x32 block).
        fp8_max: 448.0 or 57344.0.
    Returns:
        uint8 tensor of biased exponents, shape of `amax`.
    """
    rcp = torch.tensor(1.0 / fp8_max, dtype=torch.float32)
    value = amax.float() * rcp
    bits = value.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + round_up.to(torch.int32)
    exponent = torch.where(torch.isinf(value), torch.full_like(exponent, 0xFE), exponent)
    exponent = torch.where(torch.isnan(value), torch.full_like(exponent, 0xFF), exponent)
    return exponent.to(torch.uint8)


def e8m0_quant_scale(biased: torch.Tensor) -> torch.Tensor:
    """The multiplier applied before the cast for an E8M0 scale: 2^(127 - b), NaN for b = 255.

    b = 0 gives 2^127 (TE >= 2.13; before, TE special-cased it to 1 and flushed such blocks to
    zero) and b = 254 the subnormal 2^-127, as exp2f_rcp<float>. Returns float32, shape of `biased`.
    """
    exponent = 127 - biased.to(torch.int32)
    scale = torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32), exponent)
    return torch.where(biased == 255, torch.full_like(scale, float("nan")), scale)


def delayed_scale_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float,
    margin: int,
    amax_compute_algo: str,
) -> None:
    """One DelayedScaling update, in place: new scale from the history, then roll the history.

    Same arithmetic as TE's `_compute_amax_and_update_history` + `_default_sf_compute`:
    amax = max(history) ("max") or history[0] ("most_recent"); scale = (fp8_max * 2^-margin) / amax,
    kept unchanged where amax is 0 or not finite, fp32 max where it overflows; then the history
    rolls by one and slot 0 (where the next amax is written) is zeroed.

    Args:
        amax_history: float32 [history_len, ...]; slot 0 holds the amax just recorded.
        scale: float32 [...], the current quantization scale; overwritten.
        fp8_max: 448.0 or 57344.0.
        margin: the recipe margin (a power-of-two headroom exponent).
        amax_compute_algo: "max" or "most_recent".
    """
    if amax_compute_algo == "max":
        amax = amax_history.amax(dim=0)
    else:
        amax = amax_history[0].clone()
    new = torch.div(torch.full_like(amax, fp8_max * 2.0**-margin), amax)
    new = torch.where((amax > 0) & torch.isfinite(amax), new, scale)
    new = torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
    scale.copy_(new)
    amax_history.copy_(torch.roll(amax_history, -1, 0))
    amax_history[0].zero_()
