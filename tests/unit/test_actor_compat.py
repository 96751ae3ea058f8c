"""The Megatron-Core CPU layer: explicit, idempotent, scoped to the listed modules, inert with CUDA."""

import importlib
import subprocess
import sys

import pytest
import torch

from megatron_rl.actor import megatron_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def test_import_is_cheap_and_patches_nothing():
    """`import megatron_rl.actor` (and the compat module) import no Megatron and patch nothing."""
    code = ("import sys, megatron_rl.actor, megatron_rl.actor.megatron_compat as c; "
            "assert not any(m.startswith('megatron.core') for m in sys.modules), 'megatron imported'; "
            "assert not c.cpu_compat_active()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_apply_is_idempotent_and_scoped(single_parallel):
    assert megatron_compat.apply_cpu_compat() is True
    assert megatron_compat.apply_cpu_compat() is True
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    assert schedules.torch is megatron_compat.CPU_TORCH
    # Only the listed modules see the stand-in: the real torch.cuda still refuses.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    layer = importlib.import_module("megatron.core.transformer.transformer_layer")
    assert layer.torch is torch


def test_stand_in_maps_cuda_requests_to_cpu(single_parallel):
    cpu_torch = megatron_compat.CPU_TORCH
    assert cpu_torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert cpu_torch.tensor([1.0], device=cpu_torch.cuda.current_device()).device.type == "cpu"
    assert cpu_torch.empty(3, device=torch.device("cuda", 0)).device.type == "cpu"
    assert cpu_torch.cat is torch.cat and cpu_torch.Tensor is torch.Tensor
    cpu_torch.cuda.synchronize()  # no-op


def test_rng_tracker_fork_restores_the_cpu_stream(single_parallel):
    """The TP RNG tracker (dropout in TP regions) runs on the CPU generator and restores it."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)  # the outer stream is untouched by the fork
    assert not torch.equal(inside, expected)


def test_cpu_clip_scales_like_megatron():
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((4,), 3.0)
    total = (2 * 4 * 9.0) ** 0.5
    megatron_compat._clip_grad_by_total_norm_cpu(params, 1.0, total)
    coeff = 1.0 / (total + 1e-6)
    assert torch.allclose(params[0].grad, torch.full((4,), 3.0 * coeff))
    megatron_compat._clip_grad_by_total_norm_cpu(params, 100.0, 1.0)  # coeff >= 1: untouched
    assert torch.allclose(params[1].grad, torch.full((4,), 3.0 * coeff))
