"""Megatron-Core transformer layer spec for a ModelSpec: Transformer Engine on GPUs, local on CPU."""

from __future__ import annotations

from typing import Any

from megatron_rl.fp8.te_recipe import te_available
from megatron_rl.models.hf_config import ModelSpec
from megatron_rl.models.norm import LocalRMSNorm


def build_layer_spec(spec: ModelSpec, *, fp8_recipe: Any = None, use_te: bool | None = None):
    """A megatron.core ModuleSpec for one decoder layer of `spec`.

    Args:
        spec: the model.
        fp8_recipe: a megatron_rl.fp8.Fp8Recipe. On the local spec an enabled recipe
            swaps in the emulated FP8 linears (megatron_rl.models.fp8_layers); with TE the recipe
            is applied by TE itself through the TransformerConfig, not here.
        use_te: force the TE (True) or local (False) spec; None picks TE when `te_available()`.
    """
    use_te = te_available() if use_te is None else use_te
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # Local spec: norms stay separate RMSNorm modules (input_layernorm, pre_mlp_layernorm), each
    # a LocalRMSNorm so that sequence parallel can run (models/norm.py).
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    sub = layer_spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = LocalRMSNorm
    if spec.qk_norm:
        sub.self_attention.submodules.q_layernorm = LocalRMSNorm
        sub.self_attention.submodules.k_layernorm = LocalRMSNorm
    if fp8_recipe is not None and fp8_recipe.enabled:
        from megatron_rl.models.fp8_layers import apply_fp8_to_layer_spec

        layer_spec = apply_fp8_to_layer_spec(layer_spec, fp8_recipe)
    return layer_spec


def build_block_spec(layer_spec, config, use_te: bool):
    """What GPTModel takes: the TE layer spec as is, or for the local spec the block submodules
    with LocalRMSNorm as the final norm too (Megatron would pick WrappedTorchNorm there,
    transformer_block.py:255-259)."""
    if use_te:
        return layer_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=LocalRMSNorm)
