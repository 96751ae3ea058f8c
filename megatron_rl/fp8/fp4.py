"""FP4 (E2M1) numerics: the element cast, NVFP4 and MXFP4 block quantizers, the 16-point RHT.

E2M1: 1 sign, 2 exponent, 1 mantissa bit; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, no inf or NaN
encoding. The cast rounds to nearest, ties to even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and saturates at +-6 (+-inf too), exactly the decision
table of TE's reference `cast_to_fp4x2` (transformer_engine/pytorch/custom_recipes/
reference_nvfp4.py). Quantized elements are returned as float32 tensors holding E2M1 values
(unpacked: torch has no arithmetic on float4_e2m1fn_x2).

NVFP4 (TE's NVFP4BlockScaling, followed: TE 2.20.0.dev0, commit d0067d0d): two-level scaling.
  global_amax = max |x| over the tensor (FP32)
  global_encode = min(6 * 448 / global_amax, fp32 max), 1 where that is 0 (amax = inf)
  block scale s = e4m3(clamp(block_amax * (global_encode * fp32(1/6)), +-448))   (RNE)
  element q = e2m1(clamp(x * min(1 / (s * (1 / global_encode)), fp32 max), +-6))
  dequantized x' = q * ((s * global_amax) * fp32(1 / (6 * 448)))
The quantizer is `NVFP4QuantizerRef._quantize_blockwise_reference` operation for operation; the
dequantizer is `dequantize_fp4_kernel` (common/cast/nvfp4/dequantize_nvfp4.cuh). Blocks are 1 x 16
along the last dim, or 16 x 16 tiles of the last two dims (TE's default for weights); ragged edges
are zero-padded as the reference's `_pad_tensor` does.

MXFP4 (OCP Microscaling spec v1.0, section 6.3; TE has no MXFP4 training recipe): blocks of 32
along the last dim, one E8M0 scale X = 2^(floor(log2(block_amax)) - 2) (emax of E2M1 is 2),
q = e2m1(sat(x / X)). Values up to 8X exist in a block, so |x| in (6X, 8X) saturates to 6X: the
spec's clipping, not a bug. All-zero blocks get byte 0 (2^-127), as the MXFP8 path does.

RHT (NVFP4 wgrad operands): x -> x . (diag(signs) H16 / 4) on every 16 consecutive elements of the
last dim, H16 the Sylvester Hadamard matrix and `signs` TE's hard-coded vector
(tensor/nvfp4_tensor.py get_wgrad_sign_vector), so it is deterministic and reproducible. It is
orthogonal: (A R)(B R)^T = A B^T, so applying it to both wgrad operands leaves dW unchanged
before quantization while spreading outliers over 16 elements.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_rl.fp8.formats import E4M3, E8M0
from megatron_rl.fp8.kernels import AmaxReducer

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E2M1_EMAX = 2  # exponent of E2M1's largest normal (6 = 1.5 * 2^2), OCP MX spec table 4
FP32_MAX = torch.finfo(torch.float32).max
# Midpoints between neighbouring magnitudes; a tie rounds down unless the upper neighbour has the
# even (zero) mantissa: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round an already-scaled tensor to E2M1 values (RNE, saturating at +-6).

    Args:
        x: any float tensor.
    Returns:
        float32 tensor of x's shape holding values of E2M1_VALUES with x's sign (-0 for small
        negatives). +-inf -> +-6. NaN stays NaN (E2M1 cannot encode it; in NVFP4 a NaN makes the
        tensor's global amax NaN and so every dequantized value NaN, as in TE).
    """
    xf = x.float()
    magnitude = xf.abs().contiguous()
    bounds = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=xf.device)
    index = torch.bucketize(magnitude, bounds)  # a value equal to a bound gets the lower index
    for tie in _TIES_UP:
        index += magnitude == tie
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=xf.device)
    out = torch.copysign(values[index.clamp_(max=len(E2M1_VALUES) - 1)], xf)
    return torch.where(torch.isnan(xf), xf, out)


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """E2M1 values (as cast_e2m1 returns) -> 4-bit codes in uint8: sign << 3 | magnitude index
    (the E2M1 bit pattern; NaN is not encodable and raises)."""
    if torch.isnan(q).any():
        raise ValueError("e2m1_codes: NaN has no E2M1 encoding")
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=q.device)
    index = torch.searchsorted(values, q.float().abs())
    if not torch.equal(values[index.clamp(max=len(E2M1_VALUES) - 1)], q.float().abs()):
        raise ValueError("e2m1_codes: q holds values that are not E2M1")
    return (index | (torch.signbit(q).long() << 3)).to(torch.uint8)


def e2m1_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of e2m1_codes: uint8 codes -> float32 E2M1 values."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = values[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def nvfp4_quantize(
    x: torch.Tensor, tile_2d: bool = False, amax_reducer: Optional[AmaxReducer] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-quantize `x` (TE's reference arithmetic, module docstring).

    Args:
        x: float tensor [..., K] (1 x 16 blocks) or [M, K] with tile_2d (16 x 16 tiles).
        tile_2d: 16 x 16 tiles (TE's weight quantization) instead of 1 x 16 blocks.
        amax_reducer: applied in place to the float32 global amax (e.g. a MAX all-reduce over TP).
    Returns:
        (q float32 E2M1 values, x's shape; block_scale float8_e4m3fn [..., M, ceil(K/16)] or
        [ceil(M/16), ceil(K/16)] with tile_2d; global_amax float32 []).
    """
    if tile_2d and x.dim() != 2:
        raise ValueError(f"x.shape={tuple(x.shape)}: 16 x 16 NVFP4 tiles need a 2-D tensor")
    xf = x.float()
    global_amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=xf.device)
    if amax_reducer is not None:
        amax_reducer(global_amax)
    encode, decode = nvfp4_global_scales(global_amax)
    blocks, unpad = _tiles(xf, NVFP4_BLOCK if tile_2d else 1, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=(-3, -1))  # [..., rows / tile_rows, K / 16]
    multiplier = encode * torch.reciprocal(torch.tensor(E2M1_MAX, device=xf.device))
    scale = torch.minimum(block_amax * multiplier, torch.tensor(FP32_MAX, device=xf.device))
    scale = scale.clamp(-448.0, 448.0).to(E4M3)
    encode_block = torch.minimum(torch.div(1.0, scale.float() * decode),
                                 torch.tensor(FP32_MAX, device=xf.device))
    scaled = (blocks * encode_block.unsqueeze(-2).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    return unpad(cast_e2m1(scaled)), scale.reshape(_scale_shape(x, scale)), global_amax


def nvfp4_global_scales(global_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(global_encode, global_decode) float32 from the tensor amax, as TE's reference computes them."""
    amax = global_amax.float()
    encode = torch.div(torch.full_like(amax, 448.0 * E2M1_MAX), amax)
    encode = torch.minimum(encode, torch.full_like(amax, FP32_MAX))
    encode = torch.where(encode == 0, torch.ones_like(encode), encode)
    return encode, torch.div(torch.ones_like(encode), encode)


def nvfp4_dequantize(q: torch.Tensor, scale: torch.Tensor, global_amax: torch.Tensor,
                     tile_2d: bool = False) -> torch.Tensor:
    """Inverse of nvfp4_quantize as TE's dequantize_fp4_kernel: float32 of q's shape."""
    factor_inv = torch.tensor(1.0 / (448.0 * E2M1_MAX), dtype=torch.float32, device=q.device)
    block = (scale.float() * global_amax.float()) * factor_inv
    tiles, unpad = _tiles(q.float(), NVFP4_BLOCK if tile_2d else 1, NVFP4_BLOCK)
    return unpad(tiles * block.unsqueeze(-2).unsqueeze(-1))


def mxfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantize `x` along its last dim (OCP MX: 1 x 32 blocks, E8M0 scales).

    Args:
        x: float tensor [..., K].
    Returns:
        (q float32 E2M1 values of x's shape, scale float8_e8m0fnu [..., ceil(K/32)]).
    """
    blocks, unpad = _tiles(x.float(), 1, MXFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=(-3, -1))
    biased = mx_scale_exponent(block_amax)
    multiplier = torch.ldexp(torch.ones_like(block_amax), 127 - biased.to(torch.int32))
    scaled = (blocks * multiplier.unsqueeze(-2).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    return unpad(cast_e2m1(scaled)), biased.view(E8M0).reshape(_scale_shape(x, biased))


def mx_scale_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """E8M0 byte of 2^(floor(log2(amax)) - 2), clamped to [2^-127, 2^127]; 0 for amax 0, 254 for
    inf, 255 (NaN) for NaN. block_amax: float32 >= 0 -> uint8 of its shape."""
    _, exponent = torch.frexp(block_amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2) = e - 1
    biased = (exponent.to(torch.int32) - 1 - E2M1_EMAX + 127).clamp(0, 254)
    biased = torch.where(block_amax == 0, torch.zeros_like(biased), biased)
    biased = torch.where(torch.isinf(block_amax), torch.full_like(biased, 254), biased)
    biased = torch.where(torch.isnan(block_amax), torch.full_like(biased, 255), biased)
    return biased.to(torch.uint8)


def mxfp4_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of mxfp4_quantize: q * 2^(byte - 127) per block, float32 of q's shape."""
    tiles, unpad = _tiles(q.float(), 1, MXFP4_BLOCK)
    return unpad(tiles * scale.float().unsqueeze(-2).unsqueeze(-1))


def random_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """TE's wgrad RHT on 16-element groups of the last dim (K % 16 == 0), in float32, x's dtype out.

    TE's reference computes x @ (diag(signs) H16 / 4) in the input dtype (_apply_rht); the 16-term
    dot product runs in float32 here and is rounded once to x.dtype.
    """
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"x.shape={tuple(x.shape)}: the RHT needs a last dim divisible by 16")
    matrix = rht_matrix(x.device)
    out = x.float().reshape(-1, NVFP4_BLOCK) @ matrix
    return out.reshape(x.shape).to(x.dtype)


def rht_matrix(device=None) -> torch.Tensor:
    """diag(RHT_SIGNS) @ H16 / 4, float32 [16, 16] (orthogonal; entries +-0.25, exact in bf16)."""
    h = torch.ones(1, 1)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32)
    return (signs[:, None] * h * 0.25).to(device)


def _scale_shape(x: torch.Tensor, scale: torch.Tensor) -> tuple:
    return tuple(scale.shape[1:]) if x.dim() == 1 else tuple(scale.shape)


def _tiles(x: torch.Tensor, rows: int, cols: int):
    """View x [..., M, K] (1-D: [K]) as zero-padded tiles [..., M/rows, rows, K/cols, cols] and
    return (tiles, unpad) where unpad maps a tensor of the tiles' shape back to x's shape."""
    squeeze = x.dim() == 1
    xs = x.unsqueeze(0) if squeeze else x
    m, k = xs.shape[-2:]
    pad_m, pad_k = -m % rows, -k % cols
    padded = F.pad(xs, (0, pad_k, 0, pad_m)) if (pad_m or pad_k) else xs
    tiles = padded.reshape(*xs.shape[:-2], (m + pad_m) // rows, rows, (k + pad_k) // cols, cols)

    def unpad(t: torch.Tensor) -> torch.Tensor:
        out = t.reshape(*xs.shape[:-2], m + pad_m, k + pad_k)[..., :m, :k]
        return out.squeeze(0) if squeeze else out

    return tiles, unpad
