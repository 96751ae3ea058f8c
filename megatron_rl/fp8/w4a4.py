"""Rollout-side FP4 W4A4 emulation (precision.rollout_quant nvfp4 / mxfp4), in w8a8.py's style.

- "nvfp4": weights E2M1 in 1 x 16 blocks along the input dim with an E4M3 `weight_scale`
  [out, ceil(in/16)] and the FP32 tensor amax `weight_amax` (the second-level scale is
  weight_amax / (6 * 448)): the 1-D layout NVFP4 inference checkpoints use. Activations are
  quantized dynamically in 1 x 16 blocks with a per-tensor global scale from the current
  activation's amax (so, as fp8_tensorwise's dynamic activations, a row's numbers depend on the
  batch it is decoded with).
- "mxfp4": weights and activations E2M1 in 1 x 32 blocks with E8M0 scales (OCP MX), all dynamic
  per block; `weight_scale` is float8_e8m0fnu [out, ceil(in/32)].

Weights are quantized once per weight sync (load_bf16: the sync ships them in high precision and
the engine quantizes on arrival); `weight` holds the 4-bit codes unpacked, one per uint8. The GEMM
is dequantize-and-matmul in float32 (fp4.py has the arithmetic).
"""

from typing import Optional

import torch
from torch import nn

from megatron_rl.fp8 import fp4
from megatron_rl.fp8.w8a8 import QuantizedLinear, SkipSpec, swap_linears

MODES = ("nvfp4", "mxfp4")
_QUANT_BUFFERS = ("weight", "weight_scale", "weight_amax")


class W4A4Linear(QuantizedLinear):
    """nn.Linear replacement holding FP4 weights; forward quantizes activations dynamically."""

    quant_buffers = _QUANT_BUFFERS

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 mode: str = "nvfp4", dtype: torch.dtype = torch.bfloat16,
                 device: Optional[torch.device] = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        block = fp4.NVFP4_BLOCK if mode == "nvfp4" else fp4.MXFP4_BLOCK
        grid = (out_features, -(-in_features // block))
        scale_dtype = torch.float8_e4m3fn if mode == "nvfp4" else torch.float8_e8m0fnu
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones(grid, device=device).to(scale_dtype))
        amax = torch.zeros((), device=device) if mode == "nvfp4" else None
        self.register_buffer("weight_amax", amax)
        bias_t = torch.zeros(out_features, dtype=dtype, device=device) if bias else None
        self.register_buffer("bias", bias_t)
        self._dequantized: Optional[torch.Tensor] = None

    @torch.no_grad()
    def load_bf16(self, weight: torch.Tensor) -> None:
        """Quantize a high-precision [out, in] weight into this layer (once per weight sync)."""
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"weight {tuple(weight.shape)}: expected {tuple(self.weight.shape)}")
        if self.mode == "nvfp4":
            q, scale, amax = fp4.nvfp4_quantize(weight)
            self.weight_amax.copy_(amax)
        else:
            q, scale = fp4.mxfp4_quantize(weight)
        self.weight.copy_(fp4.e2m1_codes(q))
        self.weight_scale.copy_(scale)
        self.clear_cache()

    def dequantized_weight(self) -> torch.Tensor:
        """The FP4 weight dequantized to float32 [out, in], cached until the next load."""
        if self._dequantized is None or self._dequantized.device != self.weight.device:
            q = fp4.e2m1_from_codes(self.weight)
            if self.mode == "nvfp4":
                self._dequantized = fp4.nvfp4_dequantize(q, self.weight_scale, self.weight_amax)
            else:
                self._dequantized = fp4.mxfp4_dequantize(q, self.weight_scale)
        return self._dequantized

    def _fake_quant_input(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_activation(x, self.mode)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def fake_quantize_activation(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Dynamic FP4 activation quantize-dequantize: x [..., K] -> float32 [..., K].

    nvfp4: 1 x 16 blocks, global scale from amax(x) over the whole tensor; mxfp4: 1 x 32 E8M0.
    """
    if mode == "nvfp4":
        q, scale, amax = fp4.nvfp4_quantize(x)
        return fp4.nvfp4_dequantize(q, scale, amax)
    return fp4.mxfp4_dequantize(*fp4.mxfp4_quantize(x))


def quantize_model_w4a4(hf_model: nn.Module, mode: str = "nvfp4", skip: SkipSpec = None) -> nn.Module:
    """Swap every nn.Linear of an HF model for a W4A4Linear, in place (skip: as quantize_model_w8a8).

    Returns hf_model itself.
    """
    return swap_linears(hf_model, skip, lambda linear: W4A4Linear.from_linear(linear, mode=mode))
