"""Quantize / dequantize for every FP8 scaling granularity: x ~ dequantize(*quantize(x, g), g).

Granularities (all scale groups run along the LAST dim, the GEMM contraction dim, except
block128x128 which tiles the last two):

| granularity    | scale group         | scale_inv shape for x [..., M, K] | scale dtype    |
|----------------|---------------------|-----------------------------------|----------------|
| "tensorwise"   | whole tensor        | []                                | float32        |
| "rowwise"      | one row (all of K)  | [..., M, 1]                       | float32        |
| "block1x128"   | 1 x b (b = 128)     | [..., M, ceil(K / b)]             | float32        |
| "block128x128" | bm x bk (128 x 128) | [..., ceil(M / bm), ceil(K / bk)] | float32        |
| "mxfp8"        | 1 x 32              | [..., M, ceil(K / 32)]            | float8_e8m0fnu |

Partial blocks (a dim that is not a multiple of the block): the last block is shorter; its amax
is taken over the elements that exist (as if zero-padded), and q keeps x's shape. All-zero
groups get scale_inv = 1 (E8M0: byte 0 = 2^-127) and quantize to exact zeros. Non-finite inputs
are not repaired: +-inf saturates to +-max, NaN stays NaN. See scales.py for the arithmetic.
"""

import math
from typing import Optional, Union

import torch

from megatron_rl.fp8.formats import E4M3, fp8_max
from megatron_rl.fp8.kernels import (
    AmaxReducer,
    group_last_dim,
    quantize_groups,
    quantize_tiles,
    quantize_with_scale,
    tile_2d,
)
from megatron_rl.fp8.scales import scale_from_amax

GRANULARITIES = ("tensorwise", "rowwise", "block1x128", "block128x128", "mxfp8")
DEFAULT_BLOCK = {"block1x128": 128, "block128x128": (128, 128), "mxfp8": 32}
# Rows are quantized in chunks of about this many elements: the float32 temporaries (~4 MiB)
# stay in cache and are recycled by the allocator instead of being fresh page-faulting
# mappings, 3-5x faster on CPU. Without an amax_reducer only: a reducer (a collective) needs
# every amax of the tensor at once, so such a tensor is processed in one piece.
CHUNK_ELEMENTS = 1 << 20

BlockSize = Union[None, int, tuple[int, int]]


def quantize(
    x: torch.Tensor,
    granularity: str,
    fp8_dtype: torch.dtype = E4M3,
    block_size: BlockSize = None,
    *,
    power_2_scale: bool = False,
    scale: Optional[torch.Tensor] = None,
    amax_reducer: Optional[AmaxReducer] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` to FP8 with one scale per group of `granularity`.

    Args:
        x: float32 / bfloat16 / float16 tensor, at least 1-D (2-D for "block128x128").
        granularity: one of GRANULARITIES (table in the module docstring).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        block_size: None for the default (128, (128, 128), 32); an int b or (1, b) for the 1-D
            blocks; an int b or (bm, bk) for "block128x128". Must be None for tensorwise/rowwise.
        power_2_scale: round scales to powers of two (TE's power_2_scale). mxfp8 always is.
        scale: tensorwise only: a precomputed quantization scale (float32 scalar, e.g. delayed
            scaling's); the cast then saturates whatever the tensor's amax.
        amax_reducer: called on the float32 amax tensor before scales are derived, to make
            shards of one logical tensor share scales (a MAX all-reduce over TP).
    Returns:
        (q, scale_inv): q has x's shape and dtype `fp8_dtype`; scale_inv as in the table.
    """
    _check_input(x, granularity, fp8_dtype)
    if scale is not None and granularity != "tensorwise":
        raise ValueError(f"scale= is only for granularity='tensorwise', got {granularity!r}")
    if granularity in ("tensorwise", "rowwise") and block_size is not None:
        raise ValueError(f"block_size={block_size!r} given for granularity={granularity!r}")
    if granularity == "tensorwise":
        return _quantize_tensorwise(x, fp8_dtype, power_2_scale, scale, amax_reducer)
    if granularity == "block128x128":
        return _quantize_tiles(x, _block_2d(block_size), fp8_dtype, power_2_scale, amax_reducer)
    block = max(1, x.shape[-1]) if granularity == "rowwise" else _block_1d(granularity, block_size)
    mx = granularity == "mxfp8"

    def kernel(chunk):
        return quantize_groups(chunk, block, fp8_dtype, power_2_scale, amax_reducer, mx)

    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    q, scale_inv = _map_row_chunks(rows, _rows_per_chunk(x.shape[-1], amax_reducer), kernel)
    return q.reshape(x.shape), scale_inv.reshape(*x.shape[:-1], scale_inv.shape[-1])


def dequantize(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    granularity: str,
    block_size: BlockSize = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize`: q * scale_inv broadcast over each group, computed in float32.

    Args:
        q: FP8 tensor as returned by `quantize`.
        scale_inv: its scales (float32, or float8_e8m0fnu for mxfp8), shapes as in the table.
        granularity, block_size: as given to `quantize`.
        out_dtype: dtype of the result.
    Returns:
        Tensor of q's shape in `out_dtype`.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not one of {GRANULARITIES}")
    values = q.to(torch.float32)
    scales = scale_inv.to(torch.float32)
    if granularity in ("tensorwise", "rowwise"):
        return (values * scales).to(out_dtype)
    if granularity == "block128x128":
        bm, bk = _block_2d(block_size)
        tiles, unpad, _ = tile_2d(values, bm, bk)
        out = tiles * scales.unsqueeze(-1).unsqueeze(-3)
        return unpad(out).to(out_dtype)
    block = _block_1d(granularity, block_size)
    groups, unpad, _ = group_last_dim(values, block)
    return unpad(groups * scales.unsqueeze(-1)).to(out_dtype)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar (0 for an empty tensor; NaN if x holds a NaN)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # max(amax, -amin): two vectorized reductions, no |x| temporary (3-10x faster on CPU
    # than x.abs().amax() or vector_norm(ord=inf)).
    return torch.maximum(x.amax(), x.amin().neg()).float()


def _quantize_tensorwise(x, fp8_dtype, power_2_scale, scale, amax_reducer):
    if scale is None:
        value = amax(x)
        if amax_reducer is not None:
            amax_reducer(value)
        scale, scale_inv = scale_from_amax(value, fp8_max(fp8_dtype), power_2_scale)
        needs_clamp = not bool(torch.isfinite(value))
    else:
        scale = scale.float()
        scale_inv = torch.reciprocal(scale)
        needs_clamp = True

    def kernel(chunk):
        return quantize_with_scale(chunk, scale, fp8_dtype, needs_clamp), scale_inv

    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    q, _ = _map_row_chunks(rows, _rows_per_chunk(x.shape[-1], None), kernel)
    return q.reshape(x.shape), scale_inv


def _quantize_tiles(x, block, fp8_dtype, power_2_scale, amax_reducer):
    """Chunks are whole rows of tiles (multiples of bm rows) of each leading-dim matrix."""
    m, k = x.shape[-2:]
    matrices = x.reshape(math.prod(x.shape[:-2]), m, k)
    rows = max(1, _rows_per_chunk(k * block[0], amax_reducer)) * block[0]

    def kernel(chunk):
        return quantize_tiles(chunk, block, fp8_dtype, power_2_scale, amax_reducer)

    pieces = [_map_row_chunks(mat, rows, kernel) for mat in matrices]
    if not pieces:  # a leading dim of size 0
        return quantize_tiles(x, block, fp8_dtype, power_2_scale, amax_reducer)
    q = pieces[0][0] if len(pieces) == 1 else torch.stack([p[0] for p in pieces])
    scale_inv = torch.stack([p[1] for p in pieces])
    return q.reshape(x.shape), scale_inv.reshape(*x.shape[:-2], *scale_inv.shape[-2:])


def _rows_per_chunk(row_elements: int, amax_reducer: Optional[AmaxReducer]) -> int:
    if amax_reducer is not None:
        return 1 << 62
    return max(1, CHUNK_ELEMENTS // max(1, row_elements))


def _map_row_chunks(rows: torch.Tensor, rows_per_chunk: int, kernel):
    """Apply kernel (chunk [r, ...] -> (q [r, ...], scale_inv [r', ...])) over row chunks."""
    if rows.shape[0] <= rows_per_chunk:
        return kernel(rows)
    q, scales = None, []
    for start in range(0, rows.shape[0], rows_per_chunk):
        q_chunk, scale_chunk = kernel(rows[start : start + rows_per_chunk])
        if q is None:
            q = torch.empty(rows.shape, dtype=q_chunk.dtype, device=rows.device)
        q[start : start + q_chunk.shape[0]].copy_(q_chunk)
        scales.append(scale_chunk)
    return q, (torch.cat(scales) if scales[0].dim() else scales[0])


def _check_input(x: torch.Tensor, granularity: str, fp8_dtype: torch.dtype) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not one of {GRANULARITIES}")
    fp8_max(fp8_dtype)
    if not x.is_floating_point() or x.element_size() < 2:
        raise ValueError(f"x.dtype={x.dtype}: quantize takes a float16/bfloat16/float32 tensor")
    if x.dim() < (2 if granularity == "block128x128" else 1):
        raise ValueError(f"granularity={granularity!r} needs more dims than "
                         f"x.shape={tuple(x.shape)}")


def _block_1d(granularity: str, block_size: BlockSize) -> int:
    if block_size is None:
        return DEFAULT_BLOCK[granularity]
    if isinstance(block_size, int):
        block = block_size
    elif len(block_size) == 2 and block_size[0] == 1:
        block = block_size[1]
    else:
        raise ValueError(f"block_size={block_size!r} is not a 1-D block for {granularity!r}")
    if block < 1:
        raise ValueError(f"block_size={block_size!r} must be positive")
    return int(block)


def _block_2d(block_size: BlockSize) -> tuple[int, int]:
    if block_size is None:
        return DEFAULT_BLOCK["block128x128"]
    bm, bk = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if bm < 1 or bk < 1:
        raise ValueError(f"block_size={block_size!r} must be positive")
    return int(bm), int(bk)
