"""The one Transformer Engine seam: Fp8Recipe -> TE recipe object, Megatron fp8 settings, TE env.

Formats: E4M3 (max 448) for inputs and weights; grads E5M2 (max 57344) with fp8_format "hybrid"
or E4M3 with "e4m3". Where quantization happens (TE and the emulation in linear.py alike): the
two operands of each GEMM of every linear layer in the transformer blocks (QKV, output
projection, fc1, fc2): fprop (input, weight), dgrad (grad_output, weight), wgrad (grad_output,
input). Embedding, output layer, norms, attention softmax stay in high precision.

| train_recipe | TE recipe             | Megatron fp8_recipe | scales                           |
|--------------|-----------------------|---------------------|----------------------------------|
| delayed      | DelayedScaling        | "delayed"           | fp32, amax history, margin       |
| tensorwise   | Float8CurrentScaling  | "tensorwise"        | fp32 per tensor, current amax    |
| blockwise    | Float8BlockScaling    | "blockwise"         | fp32 per 1x128 / 128x128 block   |
| mxfp8        | MXFP8BlockScaling     | "mxfp8"             | E8M0 per 1x32 block (Blackwell)  |
| nvfp4        | NVFP4BlockScaling     | fp4="e2m1", "nvfp4" | E4M3 per 1x16 / 16x16 + FP32     |
| rowwise      | (none)                | (none)              | emulated layers only             |
| mxfp4        | (none)                | (none)              | emulated layers only (CPU)       |

nvfp4 runs TE's defaults (16x16 weight tiles, RHT on the wgrad operands) except stochastic
rounding of gradients, which is disabled so the GPU matches the emulation's round-to-nearest
(fp4.py cannot reproduce TE's RNG). Blackwell only (actor/settings.py check_device).

Transformer Engine is imported only inside functions here; nothing else in the package does.
"""

import os

import torch

from megatron_rl.fp8.recipe import Fp8Recipe
from megatron_rl.stack import check_supported

TE_BLOCK = 128  # Float8BlockScaling's fixed 1x128 / 128x128 block
NVFP4_ENVIRONMENT = {"NVTE_NVFP4_DISABLE_RHT": "0", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "0",
                     "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1"}
_MEGATRON_RECIPE = {"delayed": "delayed", "tensorwise": "tensorwise", "blockwise": "blockwise",
                    "mxfp8": "mxfp8"}


# Installed together by `transformer-engine[pytorch]`; a mismatched pair is a classic breakage, so
# each is held to megatron-core's tested range (megatron_rl/stack.py SUPPORTED).
TE_DISTRIBUTIONS = ("transformer-engine", "transformer-engine-torch")


def check_te_version() -> None:
    """Refuse an installed Transformer Engine outside the supported range (RuntimeError naming the
    distribution, its version, the range and the fix). Reads package metadata only: TE is not
    imported, so the NVTE_* switches it reads at import are still free to be set."""
    for dist in TE_DISTRIBUTIONS:
        check_supported(dist)


def te_available() -> bool:
    """True when CUDA is present and transformer_engine.pytorch imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.common.recipe  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # OSError/RuntimeError: broken CUDA libs
        return False
    return True


def wgrad_fusion_available() -> bool:
    """True when apex's fused_weight_gradient_mlp_cuda imports: what Megatron's
    gradient_accumulation_fusion needs (megatron-core 0.16.1 tensor_parallel/layers.py:44-48 checks
    the same import, and ColumnParallelLinear raises without it at 924-933)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # a container's apex built for another torch
        return False
    return True


def build_te_recipe(recipe: Fp8Recipe):
    """The transformer_engine.common.recipe object for `recipe` (for te.fp8_autocast).

    Raises ValueError for bf16, rowwise and mxfp4 (no TE recipe: they run emulated) and for a
    blockwise block_size other than TE's 128; ImportError when TE is not installed. nvfp4 gives
    NVFP4BlockScaling with RHT and 2-D weight tiles on and stochastic rounding off.
    """
    _check_te_mappable(recipe)
    try:
        from transformer_engine.common import recipe as te_recipe
    except ImportError as err:
        raise ImportError("build_te_recipe needs transformer_engine (pip install "
                          "'megatron_rl[gpu]' on a CUDA machine)") from err
    if recipe.name == "nvfp4":
        return te_recipe.NVFP4BlockScaling(disable_rht=False, disable_2d_quantization=False,
                                           disable_stochastic_rounding=True)
    fmt = te_recipe.Format.HYBRID if recipe.fp8_format == "hybrid" else te_recipe.Format.E4M3
    if recipe.name == "delayed":
        return te_recipe.DelayedScaling(margin=recipe.margin, fp8_format=fmt,
                                        amax_history_len=recipe.amax_history_len,
                                        amax_compute_algo=recipe.amax_compute_algo)
    if recipe.name == "mxfp8":
        return te_recipe.MXFP8BlockScaling(fp8_format=fmt)
    if recipe.name == "tensorwise":
        built = te_recipe.Float8CurrentScaling(fp8_format=fmt)
    else:
        built = te_recipe.Float8BlockScaling(fp8_format=fmt)
    # The QParams are class attributes fixed at import from NVTE_* env vars (blockwise defaults to
    # power-of-two scales); set them on the instance so the contract's choice wins.
    qparams = te_recipe.QParams(power_2_scale=recipe.power_2_scales, amax_epsilon=0.0)
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        setattr(built, name, qparams)
    return built


def megatron_fp8_kwargs(recipe: Fp8Recipe) -> dict:
    """TransformerConfig fp8 fields (megatron-core 0.16.1) for the TE layer spec.

    Megatron builds its own TE recipe from these (fp8_utils.get_fp8_recipe), so FP32 block
    scales additionally need te_environment(recipe) set before TE is imported.
    """
    if not recipe.enabled:
        return {"fp8": None}
    _check_te_mappable(recipe)
    if recipe.name == "nvfp4":
        # Megatron builds NVFP4BlockScaling() from these; its flags come from te_environment.
        return {"fp8": None, "fp4": "e2m1", "fp4_recipe": "nvfp4", "fp4_param": False}
    return {
        "fp8": recipe.fp8_format,
        "fp8_recipe": _MEGATRON_RECIPE[recipe.name],
        "fp8_margin": recipe.margin,
        "fp8_amax_history_len": recipe.amax_history_len,
        "fp8_amax_compute_algo": recipe.amax_compute_algo,
        "fp8_wgrad": True,  # wgrad GEMM in FP8 too, as the emulation does
        "fp8_param": False,  # primary weights stay high precision (the BF16 shadow needs them)
    }


def te_environment(recipe: Fp8Recipe) -> dict:
    """Environment variables TE reads at import time to follow `recipe` (set them in the launcher).

    nvfp4: NVFP4BlockScaling reads its disable_* flags from NVTE_NVFP4_* at import (class
    attributes); RHT and 2-D weight tiles on, stochastic rounding off (see the module docstring).
    NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 makes Float8BlockScaling use FP32 (not power-of-two)
    scales; NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES does the converse for tensorwise.
    """
    if recipe.name == "nvfp4":
        return dict(NVFP4_ENVIRONMENT)
    if recipe.name == "blockwise":
        return {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0" if recipe.power_2_scales else "1"}
    if recipe.name == "tensorwise":
        return {"NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "1" if recipe.power_2_scales else "0"}
    return {}


def te_environment_mismatches(recipe: Fp8Recipe) -> dict:
    """Variables of te_environment(recipe) whose current os.environ value differs: {name: value}."""
    return {k: v for k, v in te_environment(recipe).items() if os.environ.get(k, "0") != v}


def _check_te_mappable(recipe: Fp8Recipe) -> None:
    if not isinstance(recipe, Fp8Recipe):
        raise ValueError(f"recipe={recipe!r} is not an Fp8Recipe")
    if not recipe.enabled:
        raise ValueError("train_recipe='bf16' has no Transformer Engine recipe")
    if recipe.name == "mxfp4":
        raise ValueError("train_recipe='mxfp4' has no Transformer Engine recipe (TE trains FP4 only "
                         "as nvfp4); it runs on CPU on the emulated layers only, as a stress level")
    if recipe.name == "rowwise":
        raise ValueError("train_recipe='rowwise' has no Transformer Engine recipe; it runs on the "
                         "emulated FP8 layers (megatron_rl.models.fp8_layers)")
    if recipe.name == "blockwise" and recipe.block_size != TE_BLOCK:
        raise ValueError(f"block_size={recipe.block_size}: Transformer Engine's Float8BlockScaling "
                         f"uses {TE_BLOCK}")


def require_te(recipe: Fp8Recipe) -> None:
    """Build-time gate of the TE layer spec on CUDA: no silent fallback to the local spec.

    The environment is checked first, before anything imports TE (TE reads the NVTE_* scale
    switches once, at import: a mismatch found later could not be fixed in-process).
    Raises ValueError with the fix; RuntimeError for a TE outside the supported range.
    """
    bad = te_environment_mismatches(recipe)
    if bad:
        exports = " ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"config key 'precision.train_recipe': {recipe.name!r} on Transformer "
                         f"Engine needs the environment {exports} set before TE is imported "
                         f"(else its scales differ from the emulation and the rollout); export it "
                         f"where the job starts (torchrun / sbatch environment)")
    check_te_version()
    if not te_available():
        raise ValueError("config key 'parallel.transformer_impl': CUDA is present but "
                         "transformer_engine does not import; install it (pip install "
                         "'megatron_rl[gpu]') or opt out with parallel.transformer_impl=local "
                         "(emulated FP8, unfused attention)")
