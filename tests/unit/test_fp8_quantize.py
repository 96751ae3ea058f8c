"""FP8 quantizers: hand-computed values, saturation, zero/partial blocks, and a slow reference."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.fp8 import dequantize, quantize
from megatron_rl.fp8.quantization import GRANULARITIES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---------------------------------------------------------------- slow, independent reference
def _fp8_positive_values(exp_bits: int, man_bits: int, bias: int, max_value: float) -> np.ndarray:
    """All finite non-negative values of an FP8 format, decoded from the bit layout, by code."""
    values = []
    for code in range(1 << (exp_bits + man_bits)):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if e == 0:
            v = m / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        if v > max_value:
            break
        values.append(v)
    return np.array(values)


TABLE = {E4M3: _fp8_positive_values(4, 3, 7, 448.0), E5M2: _fp8_positive_values(5, 2, 15, 57344.0)}


def ref_round(v: np.ndarray, dtype) -> np.ndarray:
    """Round float32 values to the FP8 grid: nearest, ties to the even code, saturate at max."""
    table = TABLE[dtype]
    mag = np.minimum(np.abs(v.astype(np.float64)), table[-1])
    hi = np.clip(np.searchsorted(table, mag), 1, len(table) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.sign(v) * np.where(pick_hi, table[hi], table[lo])


def ref_scale(amax: float, fmax: float) -> np.float32:
    if amax == 0:
        return np.float32(1.0)
    return np.float32(fmax) / np.float32(amax)


def ref_e8m0(amax: float, fmax: float) -> int:
    """Biased exponent of 2^ceil(log2(amax * fl32(1 / fmax))), 0 for zero."""
    t = float(np.float32(amax) * np.float32(1.0 / fmax))
    if t == 0:
        return 0
    mant, exp = math.frexp(t)  # t = mant * 2^exp, mant in [0.5, 1)
    return exp - 1 + 127 + (1 if mant != 0.5 else 0)


def ref_quantize(x: np.ndarray, granularity: str, dtype, block) -> tuple[np.ndarray, np.ndarray]:
    """Loop over scale groups of a 2-D array; returns (dequantized values, scale_inv grid)."""
    fmax = float(TABLE[dtype][-1])
    m, k = x.shape
    if granularity == "tensorwise":
        bm, bk = m, k
    elif granularity == "rowwise":
        bm, bk = 1, k
    elif granularity in ("block1x128", "mxfp8"):
        bm, bk = 1, block
    else:
        bm, bk = block, block
    out = np.zeros_like(x, dtype=np.float32)
    scales = np.zeros((-(-m // bm), -(-k // bk)))
    for i in range(0, m, bm):
        for j in range(0, k, bk):
            g = x[i : i + bm, j : j + bk]
            amax = float(np.abs(g).max())
            if granularity == "mxfp8":
                b = ref_e8m0(amax, fmax)
                scale = np.float32(1.0) if b == 0 else np.float32(2.0 ** (127 - b))
                scale_inv = 2.0 ** (b - 127)
            else:
                scale = ref_scale(amax, fmax)
                scale_inv = float(np.float32(1.0) / scale)
            q = ref_round((g * scale).astype(np.float32), dtype)
            # Dequantization is one float32 multiply, as in the implementation and TE.
            out[i : i + bm, j : j + bk] = q.astype(np.float32) * np.float32(scale_inv)
            scales[i // bm, j // bk] = scale_inv
    return out, scales


# ---------------------------------------------------------------- hand-computed values
def test_tensorwise_exact_values_and_round_to_nearest_even():
    # amax 896 -> scale 448/896 = 0.5, scale_inv 2; every x*scale is on the E4M3 grid.
    x = torch.tensor([896.0, 1.0, -3.0, 0.5])
    q, s = quantize(x, "tensorwise")
    assert s.item() == 2.0
    assert q.float().tolist() == [448.0, 0.5, -1.5, 0.25]
    # amax 448 -> scale 1. 1.0625 is halfway 1.0|1.125 -> 1.0 (even); 1.1875 halfway 1.125|1.25
    # -> 1.25 (even); 2^-10 is halfway 0|2^-9 (smallest subnormal) -> 0.
    x = torch.tensor([448.0, 1.0625, 1.1875, 2.0**-10, -2.0**-9])
    q, s = quantize(x, "tensorwise")
    assert s.item() == 1.0
    assert q.float().tolist() == [448.0, 1.0, 1.25, 0.0, -(2.0**-9)]


def test_rowwise_and_block1x128_with_partial_block():
    x = torch.zeros(2, 130)
    x[0, 0], x[0, 5], x[0, 129] = 1792.0, -3.0, 7.0  # block 0 amax 1792, block 1 (2 elems) amax 7
    x[1, 128] = -0.5  # row 1: block 0 all zero, block 1 amax 0.5
    q, s = quantize(x, "block1x128")
    assert s.shape == (2, 2)
    assert s[0].tolist() == [4.0, 1.0 / 64.0]  # scales 448/1792 and 448/7 = 64
    assert s[1].tolist() == [1.0, float(np.float32(1) / np.float32(896.0))]  # zero block -> 1
    assert q[0, 0].item() == 448.0 and q[0, 5].item() == -0.75 and q[0, 129].item() == 448.0
    assert q[1, 128].item() == -448.0 and q[1, :128].float().abs().sum().item() == 0.0
    qr, sr = quantize(x, "rowwise")
    assert sr.shape == (2, 1) and sr[0, 0].item() == 4.0 and qr[0, 129].item() == 1.75


def test_block128x128_scales_and_zero_tiles():
    x = torch.zeros(130, 129)
    x[0, 0] = 0.25  # tile (0,0): scale 448/0.25 = 1792
    x[129, 128] = -896.0  # tile (1,1): scale 0.5
    q, s = quantize(x, "block128x128")
    assert s.shape == (2, 2)
    assert s[0, 1].item() == 1.0 and s[1, 0].item() == 1.0  # all-zero tiles
    assert s[1, 1].item() == 2.0 and s[0, 0].item() == float(np.float32(1) / np.float32(1792))
    assert q[0, 0].item() == 448.0 and q[129, 128].item() == -448.0
    assert dequantize(q, s, "block128x128")[129, 128].item() == -896.0


def test_mxfp8_e8m0_scales_hand_computed():
    x = torch.zeros(3, 64)
    x[0, :32] = 1.0  # 1/448 in (2^-9, 2^-8] -> scale_inv 2^-8 -> byte 119, q = 256
    x[1, 0] = 448.0 * 4  # amax/448 = 4 (exactly, up to the fl32(1/448) product) -> 2^2 or 2^3
    q, s = quantize(x, "mxfp8")
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2)
    bytes_ = s.view(torch.uint8)
    assert bytes_[0, 0].item() == 119 and q[0, 0].item() == 256.0
    assert bytes_[0, 1].item() == 0 and bytes_[2].tolist() == [0, 0]  # zero blocks: 2^-127
    assert bytes_[1, 0].item() == ref_e8m0(1792.0, 448.0)
    assert dequantize(q, s, "mxfp8")[1, 0].item() == 1792.0


def test_saturation_with_given_scale_and_non_finite():
    x = torch.tensor([1000.0, -1e6, float("inf"), 3.0])
    q, s = quantize(x, "tensorwise", scale=torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 448.0, 3.0] and s.item() == 1.0
    q, _ = quantize(x, "tensorwise", E5M2, scale=torch.tensor(1.0))
    assert q.float().tolist() == [1024.0, -57344.0, 57344.0, 3.0]
    q, s = quantize(torch.tensor([1.0, float("nan")]), "rowwise")
    assert math.isnan(q.float()[1].item())


def test_all_zero_tensor_and_empty():
    for g in GRANULARITIES:
        q, s = quantize(torch.zeros(4, 64), g)
        assert dequantize(q, s, g).abs().sum().item() == 0.0
        assert torch.isfinite(s.float()).all()
    q, s = quantize(torch.zeros(0, 8), "tensorwise")
    assert q.shape == (0, 8) and s.item() == 1.0


def test_bf16_input_multiplies_in_fp32():
    # scale = 448 / 5.5 is not a bf16 number; TE (and we) multiply x * scale in fp32.
    x = torch.tensor([5.5, 1.3], dtype=torch.bfloat16)
    q, s = quantize(x, "tensorwise")
    expect = ref_round((x.float().numpy() * ref_scale(5.5, 448.0)).astype(np.float32), E4M3)
    assert q.float().numpy().tolist() == expect.tolist()


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="granularity"):
        quantize(torch.ones(4), "block64")
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.ones(4), "rowwise", block_size=128)
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize(torch.ones(4), "tensorwise", torch.bfloat16)
    with pytest.raises(ValueError, match="needs more dims"):
        quantize(torch.ones(4), "block128x128")


def test_power_2_scales_are_powers_of_two_and_round_down():
    x = torch.tensor([[3.0, -1.0]])
    q, s = quantize(x, "block1x128", power_2_scale=True)
    # scale 448/3 = 149.33 -> 128 = 2^7, scale_inv 2^-7, q = 384.
    assert s.item() == 2.0**-7 and q[0, 0].item() == 384.0


# ---------------------------------------------------------------- round-trip bound
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_e4m3_round_trip_relative_error_at_most_2_pow_minus_4(granularity):
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 256)
    q, s = quantize(x, granularity)
    y = dequantize(q, s, granularity)
    # "In range": the scaled value x / scale_inv is an E4M3 normal (>= 2^-6), where RNE with 3
    # mantissa bits has relative error <= 2^-4. Dequantizing ones gives each element's scale_inv.
    per_element_scale_inv = dequantize(torch.ones_like(q), s, granularity)
    normal = x.abs() / per_element_scale_inv >= 2.0**-6 * (1 + 1e-6)
    rel = ((y - x).abs() / x.abs())[normal]
    assert normal.float().mean() > 0.5
    assert rel.max().item() <= 2.0**-4


# ---------------------------------------------------------------- property test vs reference
@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 140),
    k=st.integers(1, 300),
    granularity=st.sampled_from(GRANULARITIES),
    dtype=st.sampled_from([E4M3, E5M2]),
    log_scale=st.floats(-8, 8),
    seed=st.integers(0, 2**16),
)
def test_quantize_matches_slow_reference(m, k, granularity, dtype, log_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 2.0**log_scale
    x[torch.rand(m, k, generator=gen) < 0.1] = 0.0
    q, s = quantize(x, granularity, dtype)
    assert q.shape == x.shape and q.dtype == dtype
    block = 32 if granularity == "mxfp8" else 128
    ref, ref_scales = ref_quantize(x.numpy(), granularity, dtype, block)
    got = dequantize(q, s, granularity).numpy()
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(s.float().double().numpy().reshape(ref_scales.shape), ref_scales)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=3, max_size=4),
    granularity=st.sampled_from(GRANULARITIES),
)
def test_leading_dims_equal_flattened(shape, granularity):
    x = torch.randn(*shape)
    q, s = quantize(x, granularity, block_size=(8, 8) if granularity == "block128x128" else None)
    if granularity in ("tensorwise", "block128x128"):
        return  # their groups span the leading dims differently; covered above
    q2, s2 = quantize(x.reshape(-1, shape[-1]), granularity)
    assert torch.equal(q.reshape(-1, shape[-1]).float(), q2.float())
    assert torch.equal(s.float().reshape(s2.shape), s2.float())


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_chunked_quantization_equals_one_piece(granularity, monkeypatch):
    import megatron_rl.fp8.quantization as qmod

    torch.manual_seed(3)
    x = (torch.randn(3, 300, 200) * torch.logspace(-2, 2, 200)).to(torch.bfloat16)
    block = (64, 64) if granularity == "block128x128" else None
    q_one, s_one = quantize(x, granularity, block_size=block)
    monkeypatch.setattr(qmod, "CHUNK_ELEMENTS", 1000)  # 5 rows or one 64-row tile strip
    q_chunked, s_chunked = quantize(x, granularity, block_size=block)
    assert torch.equal(q_one.float(), q_chunked.float()) and q_chunked.shape == x.shape
    assert torch.equal(s_one.float(), s_chunked.float()) and s_chunked.shape == s_one.shape


def test_degenerate_shapes():
    for g in GRANULARITIES:
        for shape in [(3, 0), (0, 5), (2, 0, 4)]:
            q, s = quantize(torch.zeros(shape), g)
            assert q.shape == shape
            assert dequantize(q, s, g).shape == shape
