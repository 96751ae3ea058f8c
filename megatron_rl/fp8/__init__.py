"""FP8 and FP4 numerics: formats, quantizers, recipes, the emulated linear and the shadow switch.

Importing this package touches only torch: Transformer Engine is imported by te_recipe.py's
functions, Megatron-Core by megatron_rl.models.fp8_layers. docs/fp8.md explains the numerics.
"""

from megatron_rl.fp8.quantization import GRANULARITIES, dequantize, quantize
from megatron_rl.fp8.recipe import Fp8Recipe
from megatron_rl.fp8.switch import fp8_disabled, fp8_enabled

__all__ = ["GRANULARITIES", "Fp8Recipe", "dequantize", "fp8_disabled", "fp8_enabled", "quantize"]
