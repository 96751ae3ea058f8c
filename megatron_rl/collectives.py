"""Host-side collectives: the one place the loop, sync, checkpoint and build talk to torch.distributed.

Why a helper: on a GPU Megatron's process groups are NCCL, and NCCL refuses CPU tensors ("No
backend type associated with device type cpu"); metrics, histograms and rewards live on the host.
Every function here moves its tensor to the device the group's backend needs (CUDA for NCCL, CPU for
gloo), runs the collective, and hands the result back on the caller's device.

Waits that may last a whole rollout (non-engine ranks waiting for samples, ranks waiting for the
weight-sync owner) must not sit in an NCCL collective: NCCL's watchdog kills the job after its
timeout (30 minutes by default) and a 16-20K-token rollout tail can pass it. `HostGroups` holds a
gloo twin of each group for such waits; on a gloo world the twins are the groups themselves.

The weight-update group shared with SGLang servers (another program's ranks, outside the trainer's
world) is built, used and destroyed here too (`rendezvous_group_as_rank0`, `broadcast`,
`destroy_group`).

Only the model's own device-side collectives (vocab-parallel reductions, FP8 amaxes, TP gathers of
weights) call torch.distributed directly; tests/unit/test_collectives.py keeps the loop, sync,
checkpoint and build modules free of direct calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in `group` (1 when torch.distributed is not initialized)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a tensor must be on for a collective on `group`: CUDA for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Global rank of the member `group_rank` of `group`."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of `tensor` over `group` (op: sum | max | min); returns `tensor`.

    Works for a tensor on any device: it is copied to the group's device and back when they differ.
    """
    if group_size(group) == 1:
        return tensor
    device = group_device(group)
    work = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(work, op=_OPS[op], group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast(tensor: torch.Tensor, group_src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place broadcast of `tensor` from group rank `group_src` over `group`; returns `tensor`.

    `group` may lie outside the trainer's world (the weight-update group, whose other members are
    SGLang servers), so its own size decides, not the default group's. A tensor on another device
    than the group's backend needs is copied there and back (none is for CUDA buckets on NCCL).
    """
    if group.size() == 1:
        return tensor
    device = group_device(group)
    work = tensor if tensor.device == device else tensor.to(device)
    dist.broadcast(work, group_src=group_src, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None) -> Any:
    """`obj` of global rank `src`, on every rank of `group` (pickled; any rank may pass None)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=group_device(group))
    return box[0]


def gather_objects(obj: Any, dst: int, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's `obj`, in group order, on global rank `dst`; None on the other ranks."""
    if group_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    if dist.get_backend(group) == "nccl":  # gather_object on NCCL needs the current device set
        torch.cuda.set_device(torch.cuda.current_device())
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's `obj`, in group order, on every rank of `group`."""
    if group_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of `group`'s members, in group-rank order ([0] without torch.distributed)."""
    if not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait until every rank of `group` arrives (a no-op for one rank)."""
    if group_size(group) > 1:
        dist.barrier(group=group)


@dataclass
class HostGroups:
    """Gloo twins of a rank's model-parallel and data-parallel groups, for long host-side waits."""

    mp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    world: dist.ProcessGroup | None


def make_host_groups(mp_ranks: list[int], dp_ranks: list[int], timeout_s: float = 7200.0) -> HostGroups:
    """Gloo groups of the whole world and of this rank's model-parallel and data-parallel members,
    with an explicit timeout sized to the job's longest wait (a server start, a rollout, an
    evaluation): the default groups keep torch's default (10 min for NCCL, 30 for gloo).

    Collective over the whole world (every rank calls it, in the same order).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return HostGroups(None, None, None)
    timeout = timedelta(seconds=timeout_s)
    world = dist.new_group(backend="gloo", timeout=timeout)
    mp = gloo_subgroup(mp_ranks, world, timeout)
    dp = gloo_subgroup(dp_ranks, world, timeout)
    return HostGroups(mp, dp, world)


def gloo_subgroup(my_ranks: list[int], world: dist.ProcessGroup, timeout: timedelta) -> dist.ProcessGroup:
    """The gloo group among the partition of the world that `my_ranks` belongs to (every rank
    contributes its own member list; new_subgroups_by_enumeration creates all of them in order)."""
    everyone = all_gather_objects(sorted(my_ranks), world)
    partition = sorted({tuple(r) for r in everyone})
    mine, _ = dist.new_subgroups_by_enumeration([list(p) for p in partition], timeout=timeout, backend="gloo")
    return mine


def rendezvous_group_as_rank0(addr: str, port: int, world_size: int, group_name: str, backend: str,
                              timeout) -> dist.ProcessGroup:
    """Rank 0 of a group shared with another program (SGLang's weight-update group), built as SGLang
    builds its side (rendezvous on tcp://addr:port, a store prefixed by the group name), so both
    sides meet on the same keys. Independent of the trainer's default process group."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    # The store server, started here: under torchrun, rendezvous("tcp://...") would only make a client
    # (torchrun's agent hosts the store of ITS group) and the servers and this rank would wait forever.
    store = dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout, multi_tenant=True)
    group, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group: dist.ProcessGroup) -> None:
    """Tear down one group (its communicators), leaving the default group alone."""
    dist.destroy_process_group(group)
