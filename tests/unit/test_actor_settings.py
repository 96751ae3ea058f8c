"""resolve_settings: null/auto resolved per device, and cross-field mistakes refused by key."""

import pytest

from megatron_rl.actor.settings import check_device, resolve_settings
from megatron_rl.config import load_config


def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_gpu_defaults_are_the_scalable_ones():
    s = resolve_settings(_cfg("parallel.tensor_model_parallel_size=2"), cuda=True)
    assert (s.device, s.params_dtype, s.bytes_per_param) == ("cuda", "bf16", 2)
    assert s.sequence_parallel and s.use_distributed_optimizer
    assert s.overlap_grad_reduce and s.overlap_param_gather
    assert s.transformer_impl == "transformer_engine" and not s.fp8_emulated


def test_cpu_defaults_are_plain():
    s = resolve_settings(_cfg("precision.train_recipe=blockwise"), cuda=False)
    assert (s.device, s.params_dtype, s.bytes_per_param) == ("cpu", "fp32", 4)
    assert not (s.sequence_parallel or s.use_distributed_optimizer or s.overlap_grad_reduce
                or s.overlap_param_gather)
    assert s.transformer_impl == "local" and s.fp8_emulated
    assert s.recompute_granularity == "none"


def test_explicit_values_win_over_auto():
    cfg = _cfg("precision.params_dtype=bf16", "parallel.use_distributed_optimizer=true",
               "parallel.overlap_param_gather=true", "parallel.tensor_model_parallel_size=2",
               "parallel.sequence_parallel=true", "parallel.recompute_granularity=full",
               "parallel.recompute_method=block", "parallel.recompute_num_layers=2")
    s = resolve_settings(cfg, cuda=False)
    assert s.bf16 and s.use_distributed_optimizer and s.overlap_param_gather and s.sequence_parallel
    assert (s.recompute_granularity, s.recompute_method, s.recompute_num_layers) == ("full", "block", 2)
    gpu = resolve_settings(_cfg("precision.params_dtype=fp32", "parallel.transformer_impl=local",
                                "parallel.use_distributed_optimizer=false"), cuda=True)
    assert gpu.params_dtype == "fp32" and gpu.transformer_impl == "local"
    assert not gpu.use_distributed_optimizer and not gpu.overlap_param_gather


def test_rowwise_runs_emulated_on_purpose_on_cuda():
    s = resolve_settings(_cfg("precision.train_recipe=rowwise"), cuda=True)
    assert s.transformer_impl == "local" and s.fp8_emulated
    with pytest.raises(ValueError, match="parallel.transformer_impl=local"):
        resolve_settings(_cfg("precision.train_recipe=rowwise",
                              "parallel.transformer_impl=transformer_engine"), cuda=True)


@pytest.mark.parametrize("overrides, key", [
    (["parallel.context_parallel_size=2"], "parallel.context_parallel_size"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["parallel.overlap_param_gather=true", "parallel.use_distributed_optimizer=false"],
     "parallel.overlap_param_gather"),
])
def test_config_refuses_impossible_combinations(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _cfg(*overrides)


def test_resolution_refuses_what_the_device_cannot_run():
    with pytest.raises(ValueError, match="parallel.overlap_param_gather"):
        resolve_settings(_cfg("parallel.overlap_param_gather=true"), cuda=False)  # no dist opt on CPU
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_settings(_cfg("parallel.transformer_impl=transformer_engine"), cuda=False)


def test_mxfp8_needs_blackwell():
    s = resolve_settings(_cfg("precision.train_recipe=mxfp8"), cuda=True)
    with pytest.raises(ValueError, match=r"mxfp8.*9\.0"):
        check_device(s, "mxfp8", (9, 0))
    check_device(s, "mxfp8", (10, 0))
    check_device(s, "blockwise", (9, 0))
    check_device(resolve_settings(_cfg("precision.train_recipe=mxfp8"), cuda=False), "mxfp8", None)


def test_nvfp4_needs_blackwell_and_mxfp4_is_cpu_only():
    s = resolve_settings(_cfg("precision.train_recipe=nvfp4"), cuda=True)
    assert s.transformer_impl == "transformer_engine" and not s.fp8_emulated
    with pytest.raises(ValueError, match="'nvfp4' needs a Blackwell GPU"):
        check_device(s, "nvfp4", (9, 0))
    check_device(s, "nvfp4", (10, 0))
    with pytest.raises(ValueError, match="precision.train_recipe.*'mxfp4' has no Transformer Engine"):
        resolve_settings(_cfg("precision.train_recipe=mxfp4"), cuda=True)
    cpu = resolve_settings(_cfg("precision.train_recipe=mxfp4"), cuda=False)
    assert cpu.transformer_impl == "local" and cpu.fp8_emulated


@pytest.mark.parametrize("cuda, impl, apex, fused", [
    (True, "auto", False, False),  # TE on CUDA without apex: Megatron's output layer would raise
    (True, "auto", True, True), (True, "local", True, False), (False, "auto", True, False)])
def test_wgrad_fusion_only_with_apex_on_cuda_with_te(cuda, impl, apex, fused):
    from megatron_rl.actor.build import scale_kwargs

    s = resolve_settings(_cfg(f"parallel.transformer_impl={impl}"), cuda=cuda, wgrad_fusion=apex)
    assert s.gradient_accumulation_fusion is fused
    kwargs = scale_kwargs(None, None, s)
    assert kwargs.get("gradient_accumulation_fusion", False) is fused
    assert kwargs.get("bias_activation_fusion", False) is (cuda and impl == "auto")  # the others stay


def test_wgrad_fusion_probe_is_the_apex_import(monkeypatch):
    import sys
    import types

    from megatron_rl.fp8.te_recipe import wgrad_fusion_available

    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", None)  # import raises ImportError
    assert not wgrad_fusion_available()
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", types.ModuleType("fused_weight_gradient_mlp_cuda"))
    assert wgrad_fusion_available()

