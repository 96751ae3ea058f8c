"""CPU compatibility layer for Megatron-Core 0.16: lets its CUDA-only call sites run on CPU tensors.

Applied only by an explicit `apply_cpu_compat()` and only when CUDA is absent; on a GPU machine it
does nothing. It never touches the global `torch` or `torch.cuda`: each listed Megatron module gets
its module-level name `torch` rebound to `CPU_TORCH`, a stand-in that forwards everything to torch
except (a) factory calls asking for a CUDA device, which get the CPU, and (b) `torch.cuda`, whose
device, stream, synchronize and RNG calls map to CPU equivalents. Only code in those modules sees
it. Where a call site cannot be redirected (a tensor-type assert), the function is replaced by a
CPU version computing the same thing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from importlib.metadata import version as installed_version
from typing import Any

import torch
from packaging.version import Version

# Megatron module -> the call sites (file:line in megatron-core 0.16.1) the stand-in serves.
PATCHED_MODULES = {
    # CudaRNGStatesTracker.add / model_parallel_cuda_manual_seed: torch.cuda.get_rng_state(),
    # torch.cuda.manual_seed() (random.py:235-238, 422); the tracker's fork() runs around
    # every attention dropout (dot_product_attention.py:217), even at p=0.
    "megatron.core.tensor_parallel.random": "RNG tracker",
    # Sequence parallel: the gather / reduce-scatter outputs device=torch.cuda.current_device()
    # (mappings.py:91-181, 442) and the backward's all-gather buffer of the input
    # (layers.py:552, 597).
    "megatron.core.tensor_parallel.mappings": "SP gather/scatter buffers",
    "megatron.core.tensor_parallel.layers": "SP backward buffers",
    # GlobalMemoryBuffer.get_tensor: torch.empty(device=torch.cuda.current_device()) (utils.py:631),
    # the attention-score buffer of DotProductAttention; local_multi_tensor_l2_norm:
    # torch.tensor(device="cuda") (utils.py:1207), the grad-norm fallback without apex/TE.
    "megatron.core.utils": "global memory buffer, l2 norm",
    # get_default_causal_mask: torch.ones(sq, sq, device="cuda") (transformer/utils.py:35), the
    # causal mask of the local attention's softmax when no mask is passed.
    "megatron.core.transformer.utils": "causal mask",
    # forward_backward_*: total_num_tokens = torch.zeros(device="cuda") (schedules.py:596, 983, 2138).
    "megatron.core.pipeline_parallel.schedules": "token counter",
    # Receive buffers device=torch.cuda.current_device() (p2p_communication.py:190-202, 313, 321)
    # and torch.cuda.synchronize() after batched p2p (p2p_communication.py:242, 398).
    "megatron.core.pipeline_parallel.p2p_communication": "PP receive buffers",
    # DDP param/grad buffers device=torch.cuda.current_device() (param_and_grad_buffer.py:783-806).
    "megatron.core.distributed.param_and_grad_buffer": "DDP buffers",
    # FP32Optimizer._scale = torch.tensor(device='cuda') (optimizer.py:907); also the
    # mixed-precision wrappers' found_inf buffers (optimizer.py:473-485).
    "megatron.core.optimizer.optimizer": "optimizer scalars",
    # get_grad_norm_fp32 / count_zeros_fp32: torch.zeros(device='cuda') (clip_grads.py:90-115, 207).
    "megatron.core.optimizer.clip_grads": "grad norm",
    # DistributedOptimizer: shard buffers device=torch.cuda.current_device() (distrib_optimizer.py:
    # 791) and the checkpoint gather buffers (distrib_optimizer.py:1077).
    "megatron.core.optimizer.distrib_optimizer": "distributed optimizer buffers",
    # dist_checkpointing save: torch.cuda.synchronize() (fully_parallel.py:272, 281,
    # filesystem_async.py:230, async_utils.py:212) and flag tensors on the current device
    # (state_dict_saver.py:204, 252; async_utils.py:165, 604).
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "checkpoint sync",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "checkpoint sync",
    "megatron.core.dist_checkpointing.strategies.async_utils": "checkpoint sync",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "checkpoint flags",
    "megatron.core.dist_checkpointing.exchange_utils": "checkpoint exchange buffers",
}

# The megatron-core versions this layer (and the actor built on it) is tested with; setup.py pins
# the same range. Others are refused at start rather than failing deep inside a train step.
TESTED_MEGATRON = ("0.16.1", "0.17")  # >= first, < second

_CPU = torch.device("cpu")
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "empty_like", "zeros_like", "ones_like",
              "arange", "randn", "rand")
_applied = False


def _cpu_device(device: Any) -> Any:
    """A CUDA device request (str, torch.device or device index) -> the CPU device."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _on_cpu(factory):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA context
        return factory(*args, **kwargs)

    call.__name__ = factory.__name__
    return call


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as the patched modules see it: the CPU stands in for the current device."""

    def __init__(self) -> None:
        super().__init__("megatron_rl_cpu_cuda")
        self.current_device = lambda: _CPU
        self.synchronize = lambda *a, **k: None
        self.empty_cache = lambda: None
        self.current_stream = lambda *a, **k: None
        self.default_stream = lambda *a, **k: None
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.device_count = lambda: 1
        # The "CUDA" RNG of the TP tracker is the CPU default generator: fork() saves the CPU
        # state, swaps in the tracker's state and restores it, as on a GPU.
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = lambda seed: torch.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """`torch` as the patched modules see it (factories redirected, `cuda` replaced)."""

    def __init__(self) -> None:
        super().__init__("megatron_rl_cpu_torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


CPU_TORCH = _CpuTorch()


def _get_rng_state_cpu(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_rng_state_cpu(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_cpu(parameters, max_norm: float, total_norm: float,
                                 use_decoupled_grad: bool = False) -> None:
    """clip_grads.clip_grad_by_total_norm_fp32 minus its `type() == 'torch.cuda.FloatTensor'`
    assert (clip_grads.py:167), called by MegatronOptimizer.clip_grad_norm (optimizer.py:215).
    Same coefficient, same in-place scaling."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.detach().mul_(clip_coeff)


def _swap_tensor_method(name: str, replacement, method):
    """Runs `method` with torch.Tensor.<name> replaced, restored afterwards (also on error).

    A Tensor method cannot be redirected per module, so it is swapped only for the wrapped call.
    """

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, replacement(original))
        try:
            return method(*args, **kwargs)
        finally:
            setattr(torch.Tensor, name, original)

    return wrapped


def _tensor_cuda_is_identity(method):
    """LanguageModule.setup_embeddings_and_output_layer: `weight.data = weight.data.cuda()` before
    the embedding-group all-reduce of tied embeddings with PP > 1 (language_module.py:244)."""
    return _swap_tensor_method("cuda", lambda original: lambda self, *a, **k: self, method)


def _cpu_type_reads_as_cuda(method):
    """The mixed-precision optimizers sort parameters by `param.type()` against CUDA type names
    only ('torch.cuda.BFloat16Tensor', 'torch.cuda.FloatTensor'; optimizer.py:671-701,
    distrib_optimizer.py:361-437 and 582) and raise TypeError for anything else. Inside their
    constructors a CPU tensor's no-argument type() reads as the CUDA name of the same dtype."""

    def replacement(original):
        def type_(self, *args, **kwargs):
            name = original(self, *args, **kwargs)
            if args or kwargs or self.is_cuda or not isinstance(name, str):
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        return type_

    return _swap_tensor_method("type", replacement, method)


def check_megatron_version(version: str | None = None) -> None:
    """Refuse a megatron-core outside TESTED_MEGATRON with the fix (version: the installed one)."""
    version = installed_version("megatron-core") if version is None else version
    low, high = TESTED_MEGATRON
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(f"megatron-core {version} is untested with megatron_rl, which supports "
                           f">={low},<{high} (its CPU layer and actor follow that source); "
                           f"pip install 'megatron-core>={low},<{high}'")


def apply_cpu_compat() -> bool:
    """Check the megatron-core version, then install the CPU stand-ins into Megatron-Core;
    idempotent. Returns True if active. The stand-ins are skipped (returns False) with CUDA.
    """
    global _applied
    check_megatron_version()
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    for name in PATCHED_MODULES:
        importlib.import_module(name).torch = CPU_TORCH
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # _get/_set_cuda_rng_state index torch.cuda.default_generators (random.py:41-111).
    random._get_cuda_rng_state = _get_rng_state_cpu
    random._set_cuda_rng_state = _set_rng_state_cpu
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    for cls in (optimizer.Float16OptimizerWithFloat16Params,
                importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer):
        cls.__init__ = _cpu_type_reads_as_cuda(cls.__init__)
    # Fully parallel load: the broadcast / gather-rounds exchanges move every loaded shard to
    # the GPU for NCCL with `.cuda()` (exchange_utils.py:336, 499) and back to its device after.
    exchange = importlib.import_module("megatron.core.dist_checkpointing.exchange_utils")
    for name in ("exchange_loaded_tensors_broadcast", "exchange_loaded_tensors_gather_rounds"):
        setattr(exchange, name, _tensor_cuda_is_identity(getattr(exchange, name)))
    language_module = importlib.import_module(
        "megatron.core.models.common.language_module.language_module")
    module_cls = language_module.LanguageModule
    module_cls.setup_embeddings_and_output_layer = _tensor_cuda_is_identity(
        module_cls.setup_embeddings_and_output_layer)
    _applied = True
    return True


def cpu_compat_active() -> bool:
    return _applied
