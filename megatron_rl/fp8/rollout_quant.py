"""Rollout-side quantization of exported HF weights, as the precision contract says (design.md 3)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

NamedTensor = tuple[str, torch.Tensor]  # (HF name, tensor), as sync/buckets.py names it


@dataclass(frozen=True)
class RolloutQuantSpec:
    """What the engine expects to receive: read from the `precision` config section.

    Attributes:
        rollout_quant: "bf16" | "fp8_blockwise" | "fp8_tensorwise" | "nvfp4" | "mxfp4". The FP4
            modes (torch engine only) ship linear weights in high precision: the engine quantizes
            each weight once on arrival (fp8/w4a4.py), so nothing FP4 travels on the wire.
        weight_block_size: (rows, cols) of one weight scale block (blockwise only).
        scale_format: "fp32" | "ue8m0" (power-of-two block scales).
        high_precision: HF-name substrings of tensors that are never quantized.
        unquantized_dtype: "" (as exported) | "bfloat16": dtype of every floating tensor that is not
            quantized (norms, embeddings, biases, BF16 linears). SGLang servers hold those in BF16;
            sending the trainer's FP32 main weights doubles the bytes and the server casts anyway.
    """

    rollout_quant: str = "bf16"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_format: str = "fp32"
    high_precision: tuple[str, ...] = ("embed_tokens", "lm_head", "norm")
    unquantized_dtype: str = ""

    @classmethod
    def from_config(cls, precision) -> "RolloutQuantSpec":
        return cls(precision.rollout_quant, tuple(precision.weight_block_size),
                   precision.scale_format, tuple(precision.high_precision))

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        """Only 2-D linear weights outside the high-precision list are quantized (FP8 modes only)."""
        if self.rollout_quant in ("bf16", "nvfp4", "mxfp4") or tensor.dim() != 2 or not name.endswith(".weight"):
            return False
        return not any(part in name for part in self.high_precision)


def quantize_for_rollout(named: Iterable[NamedTensor], spec: RolloutQuantSpec) -> Iterator[NamedTensor]:
    """Yield the payload the engine takes: FP8 `X.weight` followed by its scale, others unchanged.

    Blockwise: `X.weight` float8_e4m3fn plus `X.weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)]
    (the HF / SGLang FP8 checkpoint layout). Tensorwise: `X.weight` float8_e4m3fn plus a scalar
    `X.weight_scale` (dequantization multiplier, the per-tensor FP8 checkpoint convention).
    """
    from megatron_rl.fp8 import w8a8

    wire = getattr(torch, spec.unquantized_dtype) if spec.unquantized_dtype else None
    for name, tensor in named:
        if not spec.quantizes(name, tensor):
            yield name, (tensor.to(wire) if wire is not None and tensor.is_floating_point() else tensor)
            continue
        if spec.rollout_quant == "fp8_blockwise":
            q, scale_inv = w8a8.quantize_weight_blockwise(tensor, spec.weight_block_size, spec.scale_format)
            yield name, q
            yield name + "_scale_inv", scale_inv
        else:
            q, scale = w8a8.quantize_weight_tensorwise(tensor)
            yield name, q
            yield name[: -len(".weight")] + ".weight_scale", scale
