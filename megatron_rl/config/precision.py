"""The `precision` section: the FP8 / FP4 contract of trainer, weight sync and engine."""

from __future__ import annotations

from dataclasses import dataclass, field


TRAIN_RECIPES = ("bf16", "delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4", "mxfp4")
ROLLOUT_QUANTS = ("bf16", "fp8_blockwise", "fp8_tensorwise", "nvfp4", "mxfp4")
FP4_ROLLOUT_QUANTS = ("nvfp4", "mxfp4")


@dataclass
class PrecisionConfig:
    """The precision contract (design.md section 3): read by the trainer, weight sync and engine."""

    params_dtype: str = "auto"
    """auto | bf16 | fp32. Parameter dtype of the trainer. bf16 = Megatron's Float16Module with a
    mixed-precision optimizer (FP32 main parameters and FP32 gradient accumulation), as Megatron-LM
    runs under --bf16. auto: bf16 on GPUs; on CPU what the CPU compatibility layer chooses."""
    train_recipe: str = "bf16"
    """bf16 | delayed | tensorwise | rowwise | blockwise | mxfp8 | nvfp4 | mxfp4. On CPU the FP8 and
    FP4 recipes are emulated. nvfp4 (TE NVFP4BlockScaling) needs Blackwell on GPU; mxfp4 has no TE
    recipe and runs on CPU only (docs/fp8.md, FP4)."""
    fp8_format: str = "hybrid"
    """hybrid (E4M3 forward, E5M2 backward) | e4m3. Ignored by nvfp4 / mxfp4 (every operand E2M1)."""
    amax_history_len: int = 1024
    """Delayed scaling only: length of the amax history (TE DelayedScaling default)."""
    rollout_quant: str = "bf16"
    """bf16 | fp8_blockwise (W8A8: weights 128x128, activations 1x128 dynamic) | fp8_tensorwise |
    nvfp4 | mxfp4 (W4A4 emulation, rollout.engine=torch only: weights quantized once per sync,
    activations dynamically; docs/fp8.md, Rollout W4A4)."""
    weight_block_size: list[int] = field(default_factory=lambda: [128, 128])
    scale_format: str = "fp32"
    """fp32 | ue8m0 (power-of-two scales, as DeepGEMM and Blackwell want)."""
    high_precision: list[str] = field(
        default_factory=lambda: ["embed_tokens", "lm_head", "norm"])
    """HF-name substrings of tensors that stay high precision everywhere."""


CHOICES = {
    "train_recipe": TRAIN_RECIPES,
    "fp8_format": ("hybrid", "e4m3"),
    "params_dtype": ("auto", "bf16", "fp32"),
    "rollout_quant": ROLLOUT_QUANTS,
    "scale_format": ("fp32", "ue8m0"),
}
POSITIVE: tuple[str, ...] = ()


def check_block_size(p: PrecisionConfig) -> None:
    if len(p.weight_block_size) != 2 or min(p.weight_block_size) <= 0:
        raise ValueError("config key 'precision.weight_block_size': expected two positive ints, "
                         f"got {p.weight_block_size}")
