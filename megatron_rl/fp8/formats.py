"""FP8 element formats (E4M3, E5M2), the E8M0 scale format, and saturating casts.

E4M3 (torch.float8_e4m3fn): 4 exponent bits, 3 mantissa bits, no infinities, max 448, smallest
normal 2^-6, smallest subnormal 2^-9. E5M2 (torch.float8_e5m2): max 57344, smallest normal 2^-14,
has infinities. Casts round to nearest, ties to even. E8M0 (torch.float8_e8m0fnu) is the MXFP8
scale format: a biased power-of-two exponent, 2^(b - 127), byte 255 is NaN.
"""

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu

# Largest finite magnitudes; TE's Format.E4M3 / Format.E5M2 use the same numbers.
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}

FORMAT_NAMES = {"e4m3": E4M3, "e5m2": E5M2}


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 element dtype (E4M3: 448, E5M2: 57344)."""
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"fp8_dtype={fp8_dtype} is not one of {sorted(map(str, FP8_MAX))}")
    return FP8_MAX[fp8_dtype]


def saturating_cast(x: torch.Tensor, fp8_dtype: torch.dtype, inplace: bool = False) -> torch.Tensor:
    """Cast an already-scaled float tensor to FP8, clamping to +-max first (satfinite).

    Args:
        x: any float tensor (values already multiplied by the quantization scale).
        fp8_dtype: E4M3 or E5M2.
        inplace: clamp `x` itself (for temporaries the caller owns; saves one pass).
    Returns:
        Tensor of `fp8_dtype`, same shape. NaN stays NaN; +-inf saturates to +-max, as TE's
        satfinite conversion does. Without the clamp E5M2 would keep inf and E4M3 would give NaN.
    """
    bound = fp8_max(fp8_dtype)
    clamped = x.clamp_(-bound, bound) if inplace else x.clamp(-bound, bound)
    return clamped.to(fp8_dtype)
