"""Trainer -> rollout engine weight sync: export, FP8 quantize, bucket, transport, check."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from megatron_rl import collectives
from megatron_rl.sync.buckets import NamedTensor, iter_buckets, tensor_bytes
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout
from megatron_rl.sync.transport import WeightTransport, tensor_digest


class WeightSyncError(RuntimeError):
    """The engine does not hold what was sent (check mode)."""


class WeightSync:
    """Streams the actor's weights into a rollout engine after every step.

    Usage::

        sync = WeightSync(actor, transport, RolloutQuantSpec.from_config(cfg.precision), bucket_mb=512)
        for step in ...:
            train(...)
            metrics = sync.sync()          # engine now serves version sync.version

    Only the engine rank (first rank of the model-parallel group: pp rank 0, tp rank 0) holds a
    transport; the other ranks take part in the TP all-gathers (inside `export_hf_weights`) and,
    with PP > 1, send their stage's buckets to the engine rank over the PP group.

    wait_for_owners: every rank ends sync() at a world barrier, so a client rank (sampling through
    SGLang servers another rank owns, megatron_rl.cluster.placement) never generates during their update.
    wait_group: the group of that barrier: the gloo world of collectives.HostGroups (an owner's update
    can outlast NCCL's watchdog); None: the default group.
    """

    def __init__(self, actor, transport: WeightTransport | None, quant: RolloutQuantSpec,
                 bucket_mb: float = 512.0, check: bool = False, wait_for_owners: bool = False,
                 wait_group=None, peer=None, kv_scales=None, follower=None) -> None:
        self.actor = actor
        self.transport = transport
        self.quant = quant
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.check = check
        self.wait_for_owners = wait_for_owners
        self.wait_group = wait_group
        self.peer = peer
        self.kv_scales = kv_scales
        """kv_scales() -> [(name, float32 scalar)]: an FP8 KV cache's k_scale / v_scale per layer,
        sent with every sync after the weights (pipeline stage 0's buckets: one copy)."""
        """peer(bucket) on a rank without a transport whose GPU copy feeds a server by CUDA IPC
        (sync.sglang_transport.ipc_peer); None elsewhere."""
        self.follower = follower
        """A client rank's engine (samples through servers another rank updates): told each new
        version once the owners' updates are over, so it refuses samples of older weights."""
        self.version = 0

    def _local_buckets(self) -> Iterator[list[NamedTensor]]:
        named = quantize_for_rollout(self.actor.export_hf_weights(), self.quant)
        if self.kv_scales is not None and self.actor.parallel.pp_rank == 0:
            named = itertools.chain(named, self.kv_scales())
        return iter_buckets(named, self.bucket_bytes)

    def _all_buckets(self) -> Iterator[list[NamedTensor]]:
        """This PP stage's buckets, then (engine rank only) every later stage's, in stage order."""
        par = self.actor.parallel
        if par.pp_size == 1:
            yield from self._local_buckets()
            return
        yield from _pp_relay(self._local_buckets, par)

    def close(self) -> None:
        """At the end of the run: a transport that holds a resource beyond the run's servers (the
        NCCL transport's weight group) releases it; the others hold none."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    def sync(self) -> dict[str, float]:
        """Push the current weights as version+1; returns timing, size and check metrics."""
        start = time.perf_counter()
        version = self.version + 1
        sent_bytes, num_buckets, digests = 0, 0, {}
        if self.transport is not None:
            self.transport.begin(version)
        for bucket in self._all_buckets():
            if self.transport is None:
                if self.peer is not None:
                    self.peer(bucket)
                continue  # a non-engine rank still drives the collectives inside the generator
            self.transport.send(bucket, version)
            sent_bytes += sum(tensor_bytes(t) for _, t in bucket)
            num_buckets += 1
            if self.check:
                digests.update((n, tensor_digest(t)) for n, t in bucket)
        if self.transport is not None:
            self.transport.finish(version)
        self.version = version
        seconds = time.perf_counter() - start
        metrics = {"sync/seconds": seconds, "sync/bytes": float(sent_bytes),
                   "sync/num_buckets": float(num_buckets), "sync/version": float(version),
                   "sync/gb_per_s": sent_bytes / max(seconds, 1e-9) / 1e9}
        if self.check and self.transport is not None:
            metrics["sync/check_mismatches"] = float(self._verify(digests))
        if self.wait_for_owners:
            collectives.barrier(self.wait_group)  # world: the owners' pause -> update -> continue is over
        if self.follower is not None:
            self.follower.follow_version(version)
        return metrics

    def _verify(self, digests: dict[str, str]) -> int:
        held = self.transport.checksums(sorted(digests))
        bad = sorted(n for n, d in digests.items() if held.get(n) != d)
        if bad:
            raise WeightSyncError(f"engine holds different weights than were sent for {len(bad)} "
                                  f"tensors, first: {bad[:3]}")
        return 0


def _pp_relay(local_buckets, par) -> Iterator[list[NamedTensor]]:
    """Relay each PP stage's buckets to pp rank 0 over the PP group (TP rank 0 sends).

    Runs on the pipeline-parallel group: every rank of it walks the stages in order; stage s
    broadcasts its buckets one by one, then a None sentinel. Ranks with tp_rank != 0 still build
    their buckets (the TP all-gathers need every TP rank) but take no part in the relay.
    """
    group, ranks = par.pp_group, par.pp_group_ranks
    for stage in range(par.pp_size):
        mine = stage == par.pp_rank
        source = local_buckets() if mine else None
        while True:
            payload = next(source, None) if mine else None
            if par.tp_rank == 0:  # the relay runs among the TP-rank-0 ranks of the pipeline
                payload = collectives.broadcast_object(payload, ranks[stage], group)
            if payload is None:
                break
            if par.pp_rank == 0 and par.tp_rank == 0:
                yield payload
