"""The TE seam on a CPU box: lazy imports, Megatron fp8 fields, recipe mapping errors."""

import subprocess
import sys

import pytest
import torch

from megatron_rl.fp8 import Fp8Recipe
from megatron_rl.fp8.te_recipe import (
    build_te_recipe,
    megatron_fp8_kwargs,
    te_available,
    te_environment,
    te_environment_mismatches,
)


def test_importing_fp8_touches_neither_te_nor_megatron():
    code = ("import sys, megatron_rl.fp8, megatron_rl.fp8.te_recipe, megatron_rl.fp8.w8a8, "
            "megatron_rl.fp8.linear; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'transformer_engine', 'megatron', 'sglang'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_te_available_is_false_without_cuda():
    if not torch.cuda.is_available():
        assert te_available() is False


@pytest.mark.parametrize("name", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_megatron_kwargs_are_valid_transformer_config_fields(name):
    from megatron.core.transformer.transformer_config import TransformerConfig

    recipe = Fp8Recipe(name, "e4m3", amax_history_len=16, amax_compute_algo="max", margin=1)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               **megatron_fp8_kwargs(recipe))
    assert config.fp8 == "e4m3" and config.fp8_recipe == name
    assert (config.fp8_margin, config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (
        1, 16, "max")
    assert config.fp8_wgrad is True and config.fp8_param is False


def test_bf16_rowwise_and_block_size_mapping():
    assert megatron_fp8_kwargs(Fp8Recipe("bf16")) == {"fp8": None}
    with pytest.raises(ValueError, match="rowwise"):
        megatron_fp8_kwargs(Fp8Recipe("rowwise"))
    with pytest.raises(ValueError, match="block_size=32"):
        megatron_fp8_kwargs(Fp8Recipe("blockwise", block_size=32))
    with pytest.raises(ValueError, match="bf16"):
        build_te_recipe(Fp8Recipe("bf16"))


def test_te_environment_for_fp32_block_scales(monkeypatch):
    assert te_environment(Fp8Recipe("blockwise")) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert te_environment(Fp8Recipe("blockwise", power_2_scales=True)) == {
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    assert te_environment(Fp8Recipe("mxfp8")) == {}
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    assert te_environment_mismatches(Fp8Recipe("blockwise")) == {
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert te_environment_mismatches(Fp8Recipe("blockwise")) == {}


def test_build_te_recipe_without_te_raises_import_error():
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="transformer_engine"):
            build_te_recipe(Fp8Recipe("blockwise"))
    else:
        pytest.skip("transformer_engine is installed: tests/gpu covers build_te_recipe")


def test_nvfp4_maps_to_megatron_fp4_and_mxfp4_has_no_te_recipe(monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = megatron_fp8_kwargs(Fp8Recipe("nvfp4"))
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kwargs)
    assert config.fp8 is None and config.fp4 == "e2m1" and config.fp4_recipe == "nvfp4"
    assert config.fp4_param is False
    # Megatron builds NVFP4BlockScaling() itself: its flags come from the environment.
    assert te_environment(Fp8Recipe("nvfp4")) == {
        "NVTE_NVFP4_DISABLE_RHT": "0", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "0",
        "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1"}
    monkeypatch.delenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", raising=False)
    assert te_environment_mismatches(Fp8Recipe("nvfp4")) == {"NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1"}
    for call in (megatron_fp8_kwargs, build_te_recipe):
        with pytest.raises(ValueError, match="train_recipe='mxfp4' has no Transformer Engine recipe"):
            call(Fp8Recipe("mxfp4"))
