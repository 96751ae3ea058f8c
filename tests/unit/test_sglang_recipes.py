"""The production recipes load as valid configs and differ only where the README says."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = ("qwen3_8b_grpo", "qwen3_14b_dapo", "qwen25_32b_grpo")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_variants(recipe):
    cfgs = {v: load_config(EXAMPLES / recipe / f"{v}.yaml") for v in ("bf16", "fp8", "fp8_calibrated")}
    assert (cfgs["bf16"].precision.train_recipe, cfgs["bf16"].precision.rollout_quant) == ("bf16", "bf16")
    for v in ("fp8", "fp8_calibrated"):
        assert (cfgs[v].precision.train_recipe, cfgs[v].precision.rollout_quant) == ("blockwise", "fp8_blockwise")
    assert cfgs["fp8_calibrated"].calib.enabled and not cfgs["fp8"].calib.enabled
    for cfg in cfgs.values():  # the paper's settings (paper.md section 2)
        assert cfg.train.lr == 1e-6 and cfg.algo.use_tis and cfg.algo.tis_clip == 2.0 and cfg.calib.period == 20
        assert cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt == 256
        assert cfg.rollout.engine == "sglang"
        assert cfg.rollout.sglang.weight_transport in ("tensor", "nccl", "disk")
    assert cfgs["bf16"].algo.eps_clip_high == (0.28 if "dapo" in recipe else 0.2)
