"""The project's FP8 emulation against Hopper's FP8 GEMMs on the same tensors.

emulation_on_cuda   the emulated quantizers (tensorwise, rowwise, 1x128, 128x128, MXFP8) on CUDA give the
                    CPU's FP8 bytes and scales bitwise (the contract: the emulation is device-independent)
scaled_mm_<kind>    torch's FP8 GEMM on sm_90 (tensorwise, rowwise, DeepSeek-style 1x128 x 128x128) on
                    operands the emulation quantized, against the emulation's GEMM (dequantize, matmul in
                    float64): BF16 output within 1e-2 of the largest |output| (accumulation and the
                    output rounding differ; the bytes going in are the emulation's own)
fp8_linear_vs_gemm  the emulated blockwise linear's forward (CPU) against the sm_90 1x128 x 128x128 GEMM
                    of the same x and W (1e-2 relative to the largest |output|)
TE's own quantizers against the emulation, bitwise, are tests/gpu/test_te_parity.py (commands.py).
"""

from __future__ import annotations

from common import Check, Skip

M, N, K = 256, 384, 1024  # K / 128 = 8 blocks: a multiple of 4, so no L4 padding of the 128x128 scales


def _operands(seed: int = 0):
    import torch
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=gen) * torch.logspace(-2, 1, K)).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(torch.bfloat16)
    return x, w


def emulation_on_cuda(ctx):
    import torch

    from megatron_rl.fp8 import quantize
    x, _ = _operands()
    cpu = {g: quantize(x, g) for g in ("tensorwise", "rowwise", "block1x128", "block128x128", "mxfp8")}
    ctx.need_cuda()
    bad = []
    for g, (q, s) in cpu.items():
        qc, sc = quantize(x.cuda(), g)
        same_q = torch.equal(q.view(torch.uint8), qc.cpu().view(torch.uint8))
        same_s = torch.equal(s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s,
                             (sc.view(torch.uint8) if sc.dtype == torch.float8_e8m0fnu else sc).cpu())
        if not (same_q and same_s):
            bad.append(g)
    return {"granularities": sorted(cpu), "mismatched": bad, "ok": not bad}


def _reference(qa, sa, qb, sb, ga, gb):
    """The emulation's GEMM: dequantize both operands, matmul in float64. [M, N]."""
    from megatron_rl.fp8 import dequantize
    return dequantize(qa, sa, ga).double() @ dequantize(qb, sb, gb).double().T


def _scaled_mm(kind, qa, sa, qb, sb):
    """torch's FP8 GEMM on CUDA with the emulation's bytes and scales laid out as cuBLAS wants them
    (torch/_meta_registrations.py _check_scaled_mm_sizes_v2: B column-major; 1x128 scales [M, K/128]
    with stride [1, M]; 128x128 scales of B [K/128, N/128] with stride [1, K/128])."""
    import torch
    import torch.nn.functional as F
    a, b = qa.cuda(), qb.cuda().T  # b: [K, N] column-major
    if kind == "tensorwise":
        return torch._scaled_mm(a, b, sa.cuda().reshape(()), sb.cuda().reshape(()), out_dtype=torch.bfloat16)
    if kind == "rowwise":
        return torch._scaled_mm(a, b, sa.cuda().reshape(M, 1), sb.cuda().reshape(1, N), out_dtype=torch.bfloat16)
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        raise Skip(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (blockwise recipes)")
    scale_a = sa.cuda().T.contiguous().T  # [M, K/128], stride [1, M]
    scale_b = sb.cuda().contiguous().T  # [N/128, K/128] row-major -> [K/128, N/128], stride [1, K/128]
    st = F.ScalingType
    return F.scaled_mm(a, b, scale_a, st.BlockWise1x128, scale_b, st.BlockWise128x128, output_dtype=torch.bfloat16)


GRANULARITY = {"tensorwise": ("tensorwise", "tensorwise"), "rowwise": ("rowwise", "rowwise"),
               "blockwise": ("block1x128", "block128x128")}


def scaled_mm(kind):
    def run(ctx):
        from megatron_rl.fp8 import quantize
        ga, gb = GRANULARITY[kind]
        x, w = _operands()
        (qa, sa), (qb, sb) = quantize(x, ga), quantize(w, gb)
        ref = _reference(qa, sa, qb, sb, ga, gb)
        ctx.need_cuda()
        props = __import__("torch").cuda.get_device_capability()
        if props < (8, 9):
            raise Skip(f"FP8 GEMMs need sm_89+, this is sm_{props[0]}{props[1]}")
        out = _scaled_mm(kind, qa, sa, qb, sb).double().cpu()
        rel = float((out - ref).abs().max() / ref.abs().max())
        return {"shape": [M, N, K], "max_err_rel_to_max": rel, "ok": rel < 1e-2}
    return run


def fp8_linear_vs_gemm(ctx):
    import torch

    from megatron_rl.fp8 import Fp8Recipe, quantize
    from megatron_rl.fp8.linear import Fp8Plan, fp8_linear
    x, w = _operands(seed=1)
    plan = Fp8Plan(recipe=Fp8Recipe.from_contract("blockwise", "hybrid"))
    with torch.no_grad():
        emulated = fp8_linear(x.float(), w.float(), None, plan).double()
    ctx.need_cuda()
    (qa, sa), (qb, sb) = quantize(x.float(), "block1x128"), quantize(w.float(), "block128x128")
    out = _scaled_mm("blockwise", qa, sa, qb, sb).double().cpu()
    rel = float((out - emulated).abs().max() / emulated.abs().max())
    return {"max_err_rel_to_max": rel, "ok": rel < 1e-2}


CHECKS = [Check("emulation_on_cuda", emulation_on_cuda, 30)]
CHECKS += [Check(f"scaled_mm_{k}", scaled_mm(k), 20) for k in GRANULARITY]
CHECKS += [Check("fp8_linear_vs_gemm", fp8_linear_vs_gemm, 20)]
