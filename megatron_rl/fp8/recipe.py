"""Fp8Recipe: the precision contract's train_recipe, resolved per GEMM operand role.

Every linear layer runs three GEMMs and quantizes two operands in each (TE's points):
fprop y = x W^T (input, weight), dgrad dx = dy W (grad_output, weight), wgrad dW = dy^T x
(grad_output, input). Each operand is scaled along that GEMM's contraction dim. A recipe tells,
for each role ("input", "weight", "grad_output"), the granularity, FP8 dtype and block:

| recipe     | input             | weight              | grad_output        | TE recipe            |
|------------|-------------------|---------------------|--------------------|----------------------|
| delayed    | tensor, history   | tensor, history     | tensor, history    | DelayedScaling       |
| tensorwise | tensor, current   | tensor, current     | tensor, current    | Float8CurrentScaling |
| rowwise    | per row           | per row             | per row            | (none; emulated)     |
| blockwise  | 1 x 128           | 128 x 128           | 1 x 128            | Float8BlockScaling   |
| mxfp8      | 1 x 32, E8M0      | 1 x 32, E8M0        | 1 x 32, E8M0       | MXFP8BlockScaling    |
| nvfp4      | 1 x 16 E4M3 + FP32 | 16 x 16 E4M3 + FP32 | 1 x 16 E4M3 + FP32 | NVFP4BlockScaling   |
| mxfp4      | 1 x 32, E8M0      | 1 x 32, E8M0        | 1 x 32, E8M0       | (none; emulated)     |

fp8_format "hybrid": input and weight E4M3, grad_output E5M2; "e4m3": all E4M3. The FP4 recipes
(nvfp4, mxfp4) store every operand in E2M1 and ignore fp8_format (either value is accepted, so a
config can switch recipes without touching it). nvfp4 applies TE's RHT to the wgrad operands
(input and grad_output in their columnwise use); fp4.py has the arithmetic.
"""

import dataclasses
import torch

from megatron_rl.fp8.formats import E4M3, E5M2
from megatron_rl.fp8.quantization import BlockSize

RECIPES = ("bf16", "delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4", "mxfp4")
FP4_RECIPES = ("nvfp4", "mxfp4")
FP4_GRANULARITIES = ("nvfp4", "mxfp4")
FORMATS = ("hybrid", "e4m3")
ROLES = ("input", "weight", "grad_output")
AMAX_ALGOS = ("max", "most_recent")
MX_BLOCK = 32  # fixed by the OCP MX spec and TE's MXFP8BlockScaling


@dataclasses.dataclass(frozen=True)
class OperandQuant:
    """How one GEMM operand is quantized (see quantize.quantize for the meaning of fields)."""

    granularity: str
    fp8_dtype: torch.dtype
    block_size: BlockSize = None
    # Per-tensor scale taken from the amax history instead of the current tensor.
    delayed: bool = False
    power_2_scale: bool = False
    # FP4 granularities only: random Hadamard transform before quantizing, in the wgrad GEMM.
    rht: bool = False

    @property
    def is_fp4(self) -> bool:
        """E2M1 elements (granularity nvfp4 / mxfp4); fp8_dtype is then unused."""
        return self.granularity in FP4_GRANULARITIES


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """A training FP8 recipe; `Fp8Recipe()` is bf16 (quantization off)."""

    name: str = "bf16"
    """bf16 | delayed | tensorwise | rowwise | blockwise | mxfp8 | nvfp4 | mxfp4 (train_recipe)."""
    fp8_format: str = "hybrid"
    """hybrid (E4M3 forward, E5M2 grads) | e4m3 (E4M3 everywhere). Ignored by nvfp4 / mxfp4."""
    amax_history_len: int = 1024
    """delayed: length of the amax history window (TE DelayedScaling default 1024)."""
    amax_compute_algo: str = "max"
    """delayed: "max" over the window or "most_recent"."""
    margin: int = 0
    """delayed: scale = (fp8_max / amax) / 2^margin."""
    block_size: int = 128
    """blockwise: 1 x block_size activation/grad groups, block_size^2 weight tiles (TE: 128)."""
    power_2_scales: bool = False
    """tensorwise/blockwise: round scales down to powers of two. False = FP32 scales (the contract);
    TE's Float8BlockScaling defaults to True unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1."""

    def __post_init__(self) -> None:
        _check_choice("train_recipe", self.name, RECIPES)
        _check_choice("fp8_format", self.fp8_format, FORMATS)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS)
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len={self.amax_history_len} must be >= 1")
        if self.margin < 0:
            raise ValueError(f"margin={self.margin} must be >= 0")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")

    @classmethod
    def from_contract(cls, train_recipe: str, fp8_format: str, **kw) -> "Fp8Recipe":
        """Build from the precision contract's `train_recipe` and `fp8_format` (+ any field)."""
        allowed = {f.name for f in dataclasses.fields(cls)} - {"name", "fp8_format"}
        unknown = set(kw) - allowed
        if unknown:
            raise ValueError(f"unknown Fp8Recipe option(s): {sorted(unknown)}")
        return cls(name=train_recipe, fp8_format=fp8_format, **kw)

    @property
    def enabled(self) -> bool:
        """False for bf16: layers built from this recipe never quantize."""
        return self.name != "bf16"

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 dtype of inputs and weights: always E4M3."""
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """FP8 dtype of grad_output: E5M2 for hybrid, E4M3 for e4m3."""
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    def operand(self, role: str) -> OperandQuant:
        """Quantization of the GEMM operand `role` ("input", "weight" or "grad_output")."""
        _check_choice("role", role, ROLES)
        if not self.enabled:
            raise ValueError("train_recipe='bf16' has no FP8 operands")
        dtype = self.backward_dtype if role == "grad_output" else self.forward_dtype
        if self.name in FP4_RECIPES:
            dtype = E4M3  # unused by FP4 operands (NVFP4's block scales are E4M3)
        return OperandQuant(fp8_dtype=dtype, **_LAYOUT[self.name](self, role))


def _check_choice(key: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} is not one of {choices}")


def _layout_per_tensor(recipe: Fp8Recipe, role: str) -> dict:
    delayed = recipe.name == "delayed"
    pow2 = recipe.power_2_scales and not delayed
    return {"granularity": "tensorwise", "delayed": delayed, "power_2_scale": pow2}


def _layout_rowwise(recipe: Fp8Recipe, role: str) -> dict:
    return {"granularity": "rowwise"}


def _layout_blockwise(recipe: Fp8Recipe, role: str) -> dict:
    b, pow2 = recipe.block_size, recipe.power_2_scales
    if role == "weight":
        return {"granularity": "block128x128", "block_size": (b, b), "power_2_scale": pow2}
    return {"granularity": "block1x128", "block_size": b, "power_2_scale": pow2}


def _layout_mxfp8(recipe: Fp8Recipe, role: str) -> dict:
    return {"granularity": "mxfp8", "block_size": MX_BLOCK}


def _layout_nvfp4(recipe: Fp8Recipe, role: str) -> dict:
    # TE NVFP4BlockScaling: 2-D 16 x 16 weight tiles, RHT for input and grad_output in wgrad.
    if role == "weight":
        return {"granularity": "nvfp4", "block_size": (16, 16)}
    return {"granularity": "nvfp4", "block_size": 16, "rht": True}


def _layout_mxfp4(recipe: Fp8Recipe, role: str) -> dict:
    return {"granularity": "mxfp4", "block_size": MX_BLOCK}


_LAYOUT = {
    "delayed": _layout_per_tensor,
    "tensorwise": _layout_per_tensor,
    "rowwise": _layout_rowwise,
    "blockwise": _layout_blockwise,
    "mxfp8": _layout_mxfp8,
    "nvfp4": _layout_nvfp4,
    "mxfp4": _layout_mxfp4,
}

