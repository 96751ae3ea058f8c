"""FP4 numerics (fp8/fp4.py) against slow per-element Python references written here.

The references do every FP32 operation in Python doubles and round once to float32 (exact for a
single +, *, / of float32 operands), enumerate the E2M1 / E4M3 grids by their definition and
pick the nearest value with ties to the even mantissa.
"""

import math

import numpy as np
import pytest
import torch

from megatron_rl.fp8 import Fp8Recipe, fp4
from megatron_rl.fp8.linear import Fp8Linear
from megatron_rl.fp8.quantization import dequantize, quantize

FLT_MAX = float(np.finfo(np.float32).max)
# (magnitude, mantissa bit) of every non-negative E2M1 value.
E2M1_GRID = [(0.0, 0), (0.5, 1), (1.0, 0), (1.5, 1), (2.0, 0), (3.0, 1), (4.0, 0), (6.0, 1)]
# (magnitude, mantissa) of every non-negative finite E4M3 (fn) value: subnormals m/8 * 2^-6,
# normals (1 + m/8) * 2^(e-7); e=15, m=7 is NaN.
E4M3_GRID = [(m / 8 * 2.0**-6, m) for m in range(8)] + [
    ((1 + m / 8) * 2.0 ** (e - 7), m) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]


def f32(v: float) -> float:
    return float(np.float32(v))


def nearest_even(v: float, grid, vmax: float) -> float:
    if math.isnan(v):
        return v
    a = min(abs(v), vmax)
    best = min(grid, key=lambda g: (abs(a - g[0]), g[1] % 2))[0]
    return math.copysign(best, v)


def ref_e2m1(v: float) -> float:
    return nearest_even(v, E2M1_GRID, 6.0)


def ref_e4m3(v: float) -> float:
    return nearest_even(v, E4M3_GRID, 448.0)


def ref_nvfp4(x: torch.Tensor, rows: int):
    """Slow NVFP4 quantize-dequantize of a 2-D tensor with rows x 16 blocks:
    (q, block scales as a tile grid of floats, dequantized)."""
    xs = x.float().tolist()
    m, k = len(xs), len(xs[0])
    amax = max(abs(v) for row in xs for v in row)
    enc = FLT_MAX if amax == 0 else min(f32(2688.0 / amax), FLT_MAX)
    dec = f32(1.0 / enc)
    mult = f32(enc * f32(1.0 / 6.0))
    q = [[0.0] * k for _ in range(m)]
    deq = [[0.0] * k for _ in range(m)]
    scales = []
    for i0 in range(0, m, rows):
        srow = []
        for j0 in range(0, k, 16):
            cells = [(i, j) for i in range(i0, min(i0 + rows, m)) for j in range(j0, min(j0 + 16, k))]
            bmax = max(abs(xs[i][j]) for i, j in cells)
            s = ref_e4m3(min(f32(bmax * mult), 448.0))
            denom = f32(s * dec)
            encb = FLT_MAX if denom == 0 else min(f32(1.0 / denom), FLT_MAX)
            factor = f32(f32(s * amax) * f32(1.0 / 2688.0))
            for i, j in cells:
                q[i][j] = ref_e2m1(max(-6.0, min(6.0, f32(xs[i][j] * encb))))
                deq[i][j] = f32(q[i][j] * factor)
            srow.append(s)
        scales.append(srow)
    return torch.tensor(q), torch.tensor(scales), torch.tensor(deq)


def ref_mxfp4(x: torch.Tensor):
    """Slow OCP MXFP4 (1 x 32, X = 2^(floor(log2 amax) - 2)): (q, scale exponents, dequantized)."""
    xs = x.float().tolist()
    q, deq, exps = [], [], []
    for row in xs:
        qr, dr, er = [], [], []
        for j0 in range(0, len(row), 32):
            block = row[j0 : j0 + 32]
            amax = max(abs(v) for v in block)
            e = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 2))
            for v in block:
                qv = ref_e2m1(max(-6.0, min(6.0, v * 2.0**-e)))
                qr.append(qv)
                dr.append(qv * 2.0**e)
            er.append(e)
        q.append(qr), deq.append(dr), exps.append(er)
    return torch.tensor(q), torch.tensor(exps), torch.tensor(deq)


def ref_rht(x: torch.Tensor) -> torch.Tensor:
    """x . diag(signs) H16 / 4 on 16-groups of the last dim; H16 by Kronecker powers of [[1,1],[1,-1]]."""
    h = torch.ones(1, 1)
    for _ in range(4):
        h = torch.kron(h, torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
    signs = torch.tensor([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=torch.float32)
    matrix = torch.diag(signs) @ h / 4
    return (x.float().reshape(-1, 16) @ matrix).reshape(x.shape)


# ---- E2M1 cast --------------------------------------------------------------------------------

def test_every_e2m1_value_is_kept():
    values = [s * g for g, _ in E2M1_GRID for s in (1.0, -1.0)]
    out = fp4.cast_e2m1(torch.tensor(values))
    assert out.tolist() == values
    assert torch.equal(torch.signbit(out), torch.signbit(torch.tensor(values)))


def test_e2m1_midpoints_round_to_even():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # the neighbour with mantissa bit 0
    assert fp4.cast_e2m1(torch.tensor(mids)).tolist() == expected
    assert fp4.cast_e2m1(-torch.tensor(mids)).tolist() == [-v for v in expected]
    nudged = torch.tensor(mids)
    above = torch.nextafter(nudged, torch.tensor(10.0))
    below = torch.nextafter(nudged, torch.tensor(-10.0))
    assert fp4.cast_e2m1(above).tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert fp4.cast_e2m1(below).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]


def test_e2m1_saturates_and_keeps_nan():
    x = torch.tensor([6.0, 6.5, 7.0, 1e30, float("inf"), -8.0, float("-inf"), float("nan")])
    out = fp4.cast_e2m1(x)
    assert out[:-1].tolist() == [6.0, 6.0, 6.0, 6.0, 6.0, -6.0, -6.0]
    assert math.isnan(out[-1].item())


def test_e2m1_matches_reference_on_random_values():
    x = torch.randn(3000) * 3
    assert fp4.cast_e2m1(x).tolist() == [ref_e2m1(v) for v in x.tolist()]


def test_e2m1_codes_round_trip():
    values = torch.tensor([s * g for g, _ in E2M1_GRID for s in (1.0, -1.0)])
    codes = fp4.e2m1_codes(values)
    assert codes.tolist() == [i | (8 if s < 0 else 0) for i in range(8) for s in (1.0, -1.0)]
    assert torch.equal(fp4.e2m1_from_codes(codes), values)
    with pytest.raises(ValueError, match="not E2M1"):
        fp4.e2m1_codes(torch.tensor([0.7]))


# ---- NVFP4 ------------------------------------------------------------------------------------

def test_nvfp4_block_of_amax_six_hand_computed():
    x = torch.tensor([[6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -6.0, 2.9, 0.74, 0.76, 1.24, 5.1, -3.4]])
    q, scale, amax = fp4.nvfp4_quantize(x)
    # global_encode = 2688 / 6 = 448, so the block scale is 6 * 448 / 6 = 448 (E4M3 max) and the
    # element scale 1 / (448 * (1 / 448)) = 1: the elements are the E2M1 casts of x itself.
    assert amax.item() == 6.0 and scale.float().tolist() == [[448.0]]
    assert q.tolist() == [[6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -6.0, 3.0, 0.5, 1.0, 1.0, 6.0, -3.0]]
    deq = fp4.nvfp4_dequantize(q, scale, amax)
    torch.testing.assert_close(deq, q, rtol=1e-6, atol=0)


def test_nvfp4_second_block_scale_is_proportional():
    # Global amax 6 (first block); the second block has amax 3: scale 3 * 448 / 6 = 224, elements x2.
    x = torch.cat([torch.full((16,), 6.0), torch.tensor([3.0, 1.5, 0.75, -0.3] + [0.0] * 12)])[None]
    q, scale, amax = fp4.nvfp4_quantize(x)
    assert scale.float().tolist() == [[448.0, 224.0]]
    assert q[0, 16:20].tolist() == [6.0, 3.0, 1.5, -0.5]


@pytest.mark.parametrize("shape", [(4, 64), (7, 40), (33, 50)])
def test_nvfp4_1d_matches_slow_reference(shape):
    torch.manual_seed(1)
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[1])  # blocks of very different ranges
    x[0, :16] = 0.0  # an all-zero block
    q, scale, amax = fp4.nvfp4_quantize(x)
    rq, rscale, rdeq = ref_nvfp4(x, rows=1)
    assert torch.equal(q, rq) and torch.equal(scale.float(), rscale)
    assert amax.item() == x.abs().max().item()
    assert torch.equal(fp4.nvfp4_dequantize(q, scale, amax), rdeq)


def test_nvfp4_2d_tiles_match_slow_reference():
    torch.manual_seed(2)
    x = torch.randn(40, 48) * torch.logspace(-2, 1, 40)[:, None]
    q, scale, amax = fp4.nvfp4_quantize(x, tile_2d=True)
    rq, rscale, rdeq = ref_nvfp4(x, rows=16)
    assert scale.shape == (3, 3)
    assert torch.equal(q, rq) and torch.equal(scale.float(), rscale)
    assert torch.equal(fp4.nvfp4_dequantize(q, scale, amax, tile_2d=True), rdeq)


def test_nvfp4_bf16_input_and_leading_dims():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 32).bfloat16()
    q, scale, amax = fp4.nvfp4_quantize(x)
    rq, rscale, rdeq = ref_nvfp4(x.reshape(6, 32), rows=1)
    assert scale.shape == (2, 3, 2)
    assert torch.equal(q.reshape(6, 32), rq) and torch.equal(scale.float().reshape(6, 2), rscale)


def test_nvfp4_zero_and_non_finite_tensors():
    q, scale, amax = fp4.nvfp4_quantize(torch.zeros(2, 16))
    assert amax.item() == 0 and torch.equal(fp4.nvfp4_dequantize(q, scale, amax), torch.zeros(2, 16))
    x = torch.ones(2, 16)
    x[1, 3] = float("nan")
    q, scale, amax = fp4.nvfp4_quantize(x)
    assert torch.isnan(fp4.nvfp4_dequantize(q, scale, amax)).all()  # NaN amax poisons the tensor


def test_nvfp4_amax_reducer_sets_the_global_scale():
    x = torch.full((1, 16), 3.0)
    q, scale, amax = fp4.nvfp4_quantize(x, amax_reducer=lambda a: a.fill_(6.0))
    assert amax.item() == 6.0 and scale.float().item() == 224.0 and q[0, 0].item() == 6.0


# ---- MXFP4 ------------------------------------------------------------------------------------

def test_mxfp4_hand_computed_blocks():
    x = torch.zeros(3, 32)
    x[0, :4] = torch.tensor([6.0, 3.0, -0.5, 0.2])  # amax 6: X = 2^(2 - 2) = 1
    x[1, :2] = torch.tensor([7.0, -7.9])  # amax 7.9: X = 1, both saturate to 6 (the spec's clip)
    x[2, :2] = torch.tensor([0.75, 0.1])  # amax 0.75: X = 2^(-1 - 2), 0.75 -> 6, 0.1 -> 0.8 -> 1
    q, scale = fp4.mxfp4_quantize(x)
    assert scale.view(torch.uint8)[:, 0].tolist() == [127, 127, 124]
    assert q[0, :4].tolist() == [6.0, 3.0, -0.5, 0.0]
    assert q[1, :2].tolist() == [6.0, -6.0]
    assert q[2, :2].tolist() == [6.0, 1.0]
    assert fp4.mxfp4_dequantize(q, scale)[2, :2].tolist() == [0.75, 0.125]


@pytest.mark.parametrize("shape", [(5, 64), (3, 70)])
def test_mxfp4_matches_slow_reference(shape):
    torch.manual_seed(4)
    x = torch.randn(shape) * torch.logspace(-4, 3, shape[1])
    x[1, :32] = 0.0
    q, scale = fp4.mxfp4_quantize(x)
    rq, rexp, rdeq = ref_mxfp4(x)
    assert torch.equal(q, rq)
    assert torch.equal(scale.view(torch.uint8).long() - 127, rexp)
    assert torch.equal(fp4.mxfp4_dequantize(q, scale), rdeq)


def test_mx_scale_exponent_edges():
    amax = torch.tensor([0.0, 2.0**-140, 4.0, 8.0, 2.0**127, float("inf"), float("nan")])
    assert fp4.mx_scale_exponent(amax).tolist() == [0, 0, 127, 128, 252, 254, 255]


# ---- RHT --------------------------------------------------------------------------------------

def test_rht_is_tes_orthogonal_signed_hadamard():
    r = fp4.rht_matrix()
    torch.testing.assert_close(r @ r.t(), torch.eye(16), rtol=0, atol=0)
    # Row 3 of H16 (TE nvfp4_tensor.get_hadamard_matrix) times sign -1, over 4.
    assert (r[3] * 4).tolist() == [-1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1]
    x = torch.randn(5, 32)
    assert torch.equal(fp4.random_hadamard_transform(x), ref_rht(x))
    with pytest.raises(ValueError, match="divisible by 16"):
        fp4.random_hadamard_transform(torch.randn(3, 20))


# ---- recipes and the emulated linear ----------------------------------------------------------

def test_fp4_recipe_layouts():
    nv = Fp8Recipe("nvfp4")
    assert nv.operand("weight").granularity == "nvfp4" and nv.operand("weight").block_size == (16, 16)
    assert nv.operand("input").block_size == 16 and nv.operand("input").rht
    assert nv.operand("grad_output").rht and not nv.operand("weight").rht
    mx = Fp8Recipe("mxfp4", "e4m3")  # fp8_format is accepted and ignored
    assert {mx.operand(r).granularity for r in ("input", "weight", "grad_output")} == {"mxfp4"}
    assert mx.operand("grad_output") == Fp8Recipe("mxfp4", "hybrid").operand("grad_output")
    with pytest.raises(ValueError, match="train_recipe='nvfp8'"):
        Fp8Recipe("nvfp8")


def _linear_grads(recipe_name, x, w, dy):
    layer = Fp8Linear(w.shape[1], w.shape[0], bias=False, recipe=Fp8Recipe(recipe_name))
    with torch.no_grad():
        layer.weight.copy_(w)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    return y.detach(), xg.grad, layer.weight.grad


def test_nvfp4_linear_gemms_match_reference():
    torch.manual_seed(5)
    x, w, dy = torch.randn(24, 32), torch.randn(16, 32), torch.randn(24, 16)
    y, dx, dw = _linear_grads("nvfp4", x, w, dy)
    w2d = ref_nvfp4(w, rows=16)[2]
    torch.testing.assert_close(y, ref_nvfp4(x, rows=1)[2] @ w2d.t(), rtol=1e-6, atol=1e-6)
    # dgrad: dy along N in 1 x 16; W^T's 16 x 16 tiles are W's tiles transposed.
    torch.testing.assert_close(dx, ref_nvfp4(dy, rows=1)[2] @ w2d, rtol=1e-6, atol=1e-6)
    # wgrad: tokens (24) zero-padded to 32, RHT on both operands along tokens, then 1 x 16 blocks.
    pad = torch.zeros(8, 32)
    dy_t = ref_rht(torch.cat([dy, pad[:, :16]]).t().contiguous())
    x_t = ref_rht(torch.cat([x, pad]).t().contiguous())
    expected = ref_nvfp4(dy_t, rows=1)[2] @ ref_nvfp4(x_t, rows=1)[2].t()
    torch.testing.assert_close(dw, expected, rtol=1e-6, atol=1e-6)
    exact = dy.t() @ x  # the RHT pair cancels: only quantization error remains
    assert ((dw - exact).norm() / exact.norm()).item() < 0.3


def test_mxfp4_linear_gemms_match_reference():
    torch.manual_seed(6)
    x, w, dy = torch.randn(32, 64), torch.randn(32, 64), torch.randn(32, 32)
    y, dx, dw = _linear_grads("mxfp4", x, w, dy)
    deq = lambda t: ref_mxfp4(t)[2]  # noqa: E731
    torch.testing.assert_close(y, deq(x) @ deq(w).t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, deq(dy) @ deq(w.t().contiguous()).t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, deq(dy.t().contiguous()) @ deq(x.t().contiguous()).t(),
                               rtol=1e-6, atol=1e-6)


def _relative_rms(x, x_dq):
    return ((x_dq - x).square().mean().sqrt() / x.square().mean().sqrt()).item()


def test_fp4_error_is_larger_than_blockwise_fp8():
    torch.manual_seed(7)
    x = torch.randn(256, 256)
    q, s = quantize(x, "block1x128", block_size=128)
    fp8_err = _relative_rms(x, dequantize(q, s, "block1x128", 128))
    nv_err = _relative_rms(x, fp4.nvfp4_dequantize(*fp4.nvfp4_quantize(x)))
    mx_err = _relative_rms(x, fp4.mxfp4_dequantize(*fp4.mxfp4_quantize(x)))
    # E4M3's 3 mantissa bits give ~2-3%; E2M1's one bit ~9-10% (NVFP4, E4M3 block scales) and
    # more with power-of-two MX scales (docs/fp8.md has the 4096 x 4096 table).
    assert 0.01 < fp8_err < 0.04 and 0.07 < nv_err < 0.12 and nv_err < mx_err < 0.16


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_tiny_mlp_trains_under_fp4(name):
    torch.manual_seed(8)

    def mlp(recipe):
        torch.manual_seed(9)
        return torch.nn.Sequential(Fp8Linear(32, 64, recipe=recipe), torch.nn.GELU(),
                                   Fp8Linear(64, 8, recipe=recipe))

    x, target = torch.randn(48, 32), torch.randn(48, 8)
    model, ref = mlp(Fp8Recipe(name)), mlp(Fp8Recipe())
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    ref_loss = torch.nn.functional.mse_loss(ref(x), target).item()
    first = torch.nn.functional.mse_loss(mlp(Fp8Recipe(name))(x), target).item()
    assert first != ref_loss and abs(first - ref_loss) < 0.2 * ref_loss
