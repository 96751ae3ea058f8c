"""torch.distributed + Megatron-Core parallel_state setup: TP x PP x DP, gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megatron_rl import collectives


@dataclass
class ParallelInfo:
    """This rank's place in the TP x PP x DP grid and the process groups of each dimension."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    tp_group: dist.ProcessGroup = field(repr=False)
    pp_group: dist.ProcessGroup = field(repr=False)
    dp_group: dist.ProcessGroup = field(repr=False)
    mp_group: dist.ProcessGroup = field(repr=False)
    """Model-parallel group (TP x PP): the group grad norms are reduced over."""
    tp_group_ranks: list[int] = field(default_factory=list)
    pp_group_ranks: list[int] = field(default_factory=list)
    dp_group_ranks: list[int] = field(default_factory=list)
    backend: str = "gloo"

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last PP stage in this rank's pipeline (same TP/DP coordinates)."""
        return self.pp_group_ranks[-1]

    def dp_reducer(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`reduce(t) -> t`: in-place SUM all-reduce over the data-parallel group (for metrics and
        the calibrated-clipping histograms, which need the global counts)."""
        group = self.dp_group

        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            return collectives.all_reduce(tensor, group)  # on the group's device, result back here

        return reduce


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group(backend: str | None) -> str:
    """Joins torchrun's process group (RANK/WORLD_SIZE/MASTER_*), or makes a 1-process one."""
    if dist.is_initialized():
        return dist.get_backend()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        return backend
    # Single process (tests, laptop): loopback only, a free port.
    init = f"tcp://127.0.0.1:{_free_port()}"
    dist.init_process_group(backend, init_method=init, rank=0, world_size=1)
    return backend


def init_parallel(tp: int = 1, pp: int = 1, *, backend: str | None = None,
                  seed: int = 0) -> ParallelInfo:
    """Initialize torch.distributed (if needed) and Megatron's parallel_state; DP = world / (tp*pp).

    On CPU this also applies the Megatron-Core CPU compatibility layer (megatron_compat) and seeds
    the model-parallel RNG tracker. Raises ValueError if tp*pp does not divide the world size.
    """
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_rl.actor.megatron_compat import apply_cpu_compat

    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_model_parallel_size={tp} and pipeline_model_parallel_size={pp} "
                         "must be >= 1")
    backend = _init_process_group(backend)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tensor_model_parallel_size={tp} "
                         f"x pipeline_model_parallel_size={pp}")
    apply_cpu_compat()
    if not _initialized_as(mps, tp, pp):
        _destroy_megatron_groups(mps)
        registered = _registered_groups()
        mps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        _MEGATRON_GROUPS.extend(_registered_groups() - registered)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return current_parallel(backend)


# The process groups Megatron's parallel_state made at the last init: its destroy_model_parallel()
# only forgets them, and each gloo group keeps three threads until destroyed (a process that
# re-initialized per run grew by 17 groups, 51 threads, every time).
_MEGATRON_GROUPS: list[dist.ProcessGroup] = []


def _registered_groups() -> set[dist.ProcessGroup]:
    """Every process group torch.distributed holds (the default one included)."""
    return set(dist.distributed_c10d._world.pg_map)  # no public listing of groups in torch 2.x


def _initialized_as(mps, tp: int, pp: int) -> bool:
    """parallel_state is live at these sizes on the current default group: a re-init would only
    make the same groups again."""
    return (mps.model_parallel_is_initialized() and bool(_MEGATRON_GROUPS)
            and _registered_groups().issuperset(_MEGATRON_GROUPS)
            and (mps.get_tensor_model_parallel_world_size(), mps.get_pipeline_model_parallel_world_size()) == (tp, pp))


def _destroy_megatron_groups(mps) -> None:
    """Forget parallel_state and destroy the groups it made (those still registered)."""
    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    for group in _registered_groups().intersection(_MEGATRON_GROUPS):
        dist.destroy_process_group(group)
    _MEGATRON_GROUPS.clear()


def current_parallel(backend: str | None = None) -> ParallelInfo:
    """ParallelInfo of the already-initialized Megatron parallel_state."""
    from megatron.core import parallel_state as mps

    tp_group = mps.get_tensor_model_parallel_group()
    pp_group = mps.get_pipeline_model_parallel_group()
    dp_group = mps.get_data_parallel_group()
    return ParallelInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        tp_rank=mps.get_tensor_model_parallel_rank(), tp_size=mps.get_tensor_model_parallel_world_size(),
        pp_rank=mps.get_pipeline_model_parallel_rank(),
        pp_size=mps.get_pipeline_model_parallel_world_size(),
        dp_rank=mps.get_data_parallel_rank(), dp_size=mps.get_data_parallel_world_size(),
        tp_group=tp_group, pp_group=pp_group, dp_group=dp_group,
        mp_group=mps.get_model_parallel_group(),
        tp_group_ranks=dist.get_process_group_ranks(tp_group),
        pp_group_ranks=dist.get_process_group_ranks(pp_group),
        dp_group_ranks=dist.get_process_group_ranks(dp_group),
        backend=backend or dist.get_backend(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's parallel_state and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as mps

    _destroy_megatron_groups(mps)
    if dist.is_initialized():
        dist.destroy_process_group()
    # A destroyed gloo group's threads end with its object, which the model's reference cycles keep
    # until the cyclic collector runs: a process that builds runs one after another (a harness, the
    # tests) otherwise holds thousands of idle threads between collections.
    gc.collect()
