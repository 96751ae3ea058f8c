"""Value tests of cluster/memory.py's trainer state for every crossing of TP x PP x DP x distributed
optimizer x parameter dtype x device, and of `auto` resolved per device: BF16 weights 2 bytes and
FP32 4, an FP32 gradient buffer, the FP32 master copy only under mixed precision, Adam's two FP32
moments, optimizer state (not weights or gradients) sharded over DP only with the distributed
optimizer (Megatron-LM theoretical_memory_usage.py: 18 bytes per parameter, 6 + 12 / DP sharded).
The per-shard parameter count is checked against published totals in tests/unit/test_plan.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.cluster.memory import CUDA_CONTEXT_GB, GB, stage_params, trainer_memory
from megatron_rl.config import load_config
from megatron_rl.models.hf_config import ModelSpec

SPEC = ModelSpec.from_hf_config(Path(__file__).parents[1] / "data" / "hf_configs" / "qwen3_8b.json")


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 8]),
       st.sampled_from(["true", "false", "auto"]), st.sampled_from(["bf16", "fp32", "auto"]), st.booleans())
def test_weights_grads_and_optimizer_bytes_per_parameter(tp, pp, dp, dist_opt, dtype, cuda):
    overrides = [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
                 f"precision.params_dtype={dtype}"]
    if dist_opt != "auto":
        overrides.append(f"parallel.use_distributed_optimizer={dist_opt}")
    mem = trainer_memory(load_config(None, overrides), SPEC, dp=dp, cuda=cuda)
    bf16 = dtype == "bf16" or (dtype == "auto" and cuda)  # auto: BF16 on GPUs, the CPU default (FP32) here
    sharded = dist_opt == "true" or (dist_opt == "auto" and cuda)
    params = stage_params(SPEC, tp, pp)[0]
    assert mem["weights"] == pytest.approx(params * (2 if bf16 else 4))
    assert mem["grads"] == pytest.approx(params * 4)
    assert mem["optimizer"] == pytest.approx(params * ((4 if bf16 else 0) + 8) / (dp if sharded else 1))
    assert mem["cuda_context"] == (CUDA_CONTEXT_GB * GB if cuda else 0.0)
    if bf16 and not sharded:
        assert mem["weights"] + mem["grads"] + mem["optimizer"] == pytest.approx(18 * params)
