"""SGLang weight transports: tensor (colocated, CUDA IPC) and NCCL broadcast (disaggregated).

Both drive an `SGLangEngine` with the ordering contract of `megatron_rl.sync.transport`::

    transport.begin(v)        # pause_generation on every server, flush_cache
    transport.send(bucket, v) # one flattened bucket per call (a weight and its scale together)
    transport.finish(v)       # flush_cache, every server at weight_version v, continue_generation
    transport.checksums(names)

Check mode: SGLang fuses (qkv, gate_up) and TP-shards what it holds, so the HF-named digests that
were sent cannot be read back. `checksums` returns the digests of the tensors every server
acknowledged, after SGLang's /weights_checker says all replicas hold identical weights and that they
changed from the previous version; a server that missed a bucket fails one of the two.
"""

from __future__ import annotations

import datetime
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_rl import collectives
from megatron_rl.rollout.sglang_payload import (LOAD_FORMAT, distributed_spec, flatten_bucket,
                                                serialize_flattened)
from megatron_rl.sync.buckets import NamedTensor
from megatron_rl.sync.transport import tensor_digest

log = logging.getLogger(__name__)


class _Checked:
    """Digests of what every server acknowledged, plus the replica/change check of check mode."""

    def __init__(self, engine, check: bool):
        self.engine, self.check = engine, check
        self.acked: dict[str, str] = {}
        self.previous: tuple[list, dict] | None = None

    def record(self, bucket: list[NamedTensor]) -> None:
        self.engine.note_sent(n for n, _ in bucket)
        if self.check:
            self.acked.update((n, tensor_digest(t)) for n, t in bucket)

    def verify(self, names: list[str]) -> dict[str, str]:
        replies = self.engine.check_weights()
        per_server = [r.get("per_engine_checksum") for r in replies]
        if len(set(per_server)) != 1:
            raise RuntimeError(f"SGLang replicas hold different weights after the update: {per_server}")
        sent = {n: self.acked[n] for n in names if n in self.acked}
        if self.previous is not None and per_server == self.previous[0] and sent != self.previous[1]:
            raise RuntimeError("SGLang weights_checker checksum did not change although new weights were sent")
        self.previous = (per_server, sent)
        return sent


class SGLangTensorTransport:
    """Colocated: each bucket is flattened into a NEW buffer and handed to the servers by CUDA IPC
    (update_weights_from_tensor, load_format flattened_bucket). The buffer is never reused: SGLang
    answers before its device copy is done, so writing into the buffer again could corrupt weights.

    Every TP rank of a server needs an IPC handle of a buffer on its own GPU (a handle to another
    GPU's buffer costs that server a CUDA context on the other GPU and a cross-GPU copy):
    `gather(payload) -> list[str] | None` collects the payloads on the sending rank (see
    `GlooGather`; the other ranks run `ipc_peer`), either one per GPU of the host in GPU order
    (server i, on GPUs i*tp .. i*tp+tp-1, gets that slice, as slime hands each engine the handles
    of its own GPUs) or one per TP rank of a single server group.
    """

    def __init__(self, engine, check: bool = False, gather=None):
        self.engine = engine
        self.gather = gather
        """Set by loop.build.wire_ipc_gather on a colocated host (every rank's own GPU copy)."""
        self.checked = _Checked(engine, check)

    def _check_gather(self) -> None:
        if self.gather is None and any(s.tp_size > 1 for s in self.engine.servers):
            raise ValueError("rollout.sglang.tp_size > 1 with the tensor transport: SGLang's TP rank r opens "
                             "only payload r (managers/tp_worker.py deserialize_own_rank), a handle of memory on "
                             "its own GPU; give the transport a gather over the server's GPUs (GlooGather)")

    def begin(self, version: int) -> None:
        self._check_gather()
        self.engine.pause()
        self.engine.flush_cache()
        self.engine.begin_update(version)

    def send(self, bucket: list[NamedTensor], version: int) -> None:
        flat, metadata = flatten_bucket(bucket)
        payload = serialize_flattened(flat, metadata)
        payloads = self.gather(payload) if self.gather is not None else None
        if self.gather is not None and payloads is None:
            return  # a non-sending rank of the gather group
        if payloads is None and flat.is_cuda and len(self.engine.servers) > 1:
            raise ValueError(f"{len(self.engine.servers)} colocated servers and one CUDA payload: every server "
                             "but the one on this GPU would open IPC handles of another GPU's memory; the "
                             "transport needs a gather over the host's GPUs (loop.build.wire_ipc_gather)")
        posts = []  # (server, body): each server's own payloads (index = its place on the host's GPUs)
        for index, server in enumerate(self.engine.servers):
            if server.down:
                continue  # found dead at begin(): out of this update (SGLangEngine.pause)
            per_rank = payloads_for_server(payloads, index, server.tp_size) if payloads is not None else [payload]
            posts.append((server, {"serialized_named_tensors": per_rank, "load_format": LOAD_FORMAT,
                                   "flush_cache": False, "weight_version": str(version)}))
        with ThreadPoolExecutor(max_workers=max(1, len(posts))) as pool:  # every server copies at once
            calls = [pool.submit(self.engine.broadcast, "/update_weights_from_tensor", body, [server])
                     for server, body in posts]
            for call in calls:
                call.result()
        self.checked.record(bucket)
        if hasattr(self.gather, "done"):
            self.gather.done()  # the peers may drop their buffers: every server has opened its handle
        del flat  # the consumer holds its own reference to the IPC memory now

    def finish(self, version: int) -> None:
        self.engine.finish_update(version)
        self.engine.resume()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free IPC buffers the servers have released

    def checksums(self, names: list[str]) -> dict[str, str]:
        return self.checked.verify(names)


def payloads_for_server(payloads: list[str], index: int, tp_size: int) -> list[str]:
    """Server `index`'s payloads, one per TP rank: the whole list when it holds one server group's
    (len == tp_size), else the slice of its GPUs (servers numbered from GPU 0, tp_size GPUs each)."""
    if len(payloads) == tp_size:
        return payloads
    part = payloads[index * tp_size:(index + 1) * tp_size]
    if len(part) != tp_size:
        raise ValueError(f"{len(payloads)} gathered payloads hold no slice for server {index} "
                         f"(tp_size {tp_size}): the gather group must cover every GPU of the host")
    return part


class GlooGather:
    """gather(payload) for SGLangTensorTransport: every rank of `group` (gloo; the host's ranks in
    GPU order, or one server's) calls it; global rank `src` gets the list in group-rank order, the
    others None. `done()` ends a bucket on every rank (the peers' buffers stay alive until then)."""

    def __init__(self, group, src: int):
        self.group, self.src = group, src

    def __call__(self, payload: str):
        return collectives.gather_objects(payload, self.src, self.group)

    def done(self) -> None:
        collectives.barrier(self.group)


def ipc_peer(group, src: int):
    """peer(bucket) for WeightSync on the non-sending ranks of a GlooGather group: this rank's
    copy of the bucket, flattened on its own GPU, goes to the sender as an IPC payload; the buffer
    is kept until the sender has handed it to the servers."""
    gather = GlooGather(group, src)

    def peer(bucket: list[NamedTensor]) -> None:
        flat, metadata = flatten_bucket(bucket)
        gather(serialize_flattened(flat, metadata))
        gather.done()

    return peer


class SGLangNcclTransport:
    """Disaggregated: the trainer's engine rank (rank 0 of a dedicated group) broadcasts each
    flattened bucket to every server's TP ranks (update_weights_from_distributed, flattened_bucket).

    The group: world = 1 + sum of server tp sizes; server i's ranks start at 1 + sum of the tp sizes
    before it. It is created on the first begin() (init_weights_update_group on every server while
    this rank joins) and again, on a fresh port, after a server restart. A lock serializes the use
    of the group: two broadcasts interleaving on one NCCL group deadlock.
    """

    def __init__(self, engine, master_addr: str, master_port: int, group_name: str = "megatron_rl_weights",
                 backend: str = "nccl", check: bool = False, device: str | None = None,
                 timeout_s: float = 600.0):
        self.engine = engine
        self.master_addr, self.master_port = master_addr, master_port
        self.group_name, self.backend = group_name, backend
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.checked = _Checked(engine, check)
        self.lock = threading.Lock()
        self.group = None
        self._epoch = 0
        self._members: list[tuple[str, int]] = []

    def begin(self, version: int) -> None:
        self.engine.pause()
        self.engine.flush_cache()
        members = [(s.url, s.restarts) for s in self._live()]
        if self.group is None or members != self._members:
            self._init_group()
            self._members = members
        self.engine.begin_update(version)

    def _init_group(self) -> None:
        with self.lock:
            if self.group is not None:
                self.engine.broadcast("/destroy_weights_update_group", {"group_name": self._name()},
                                      servers=self._holders())
                collectives.destroy_group(self.group)
                self._epoch += 1
            world, offsets, live = 1, [], self._live()
            for server in live:
                offsets.append(world)
                world += server.tp_size
            bodies = [{"master_address": self.master_addr, "master_port": self.master_port + self._epoch,
                       "rank_offset": off, "world_size": world, "group_name": self._name(),
                       "backend": self.backend} for off in offsets]
            with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
                calls = [pool.submit(self.engine.broadcast, "/init_weights_update_group", b, [s])
                         for b, s in zip(bodies, live)]
                self.group = collectives.rendezvous_group_as_rank0(
                    self.master_addr, self.master_port + self._epoch, world, self._name(), self.backend, self.timeout)
                for call in calls:
                    call.result()

    def _live(self) -> list:
        """The servers taking part in this update (one found dead at pause() is left out)."""
        return [s for s in self.engine.servers if not s.down]

    def _holders(self) -> list:
        """The servers that joined the current group: the processes it was formed with. One restarted
        since never had it; one restarted before (and then joined) does."""
        return [s for s in self._live() if (s.url, s.restarts) in self._members]

    def _name(self) -> str:
        return f"{self.group_name}_{self._epoch}"

    def close(self) -> None:
        """At the end of the run: the servers leave the weight group, and this rank destroys its side,
        so the name can be used again in this process (a second run, a notebook)."""
        with self.lock:
            if self.group is None:
                return
            try:
                self.engine.broadcast("/destroy_weights_update_group", {"group_name": self._name()},
                                      servers=self._holders())
            except Exception as err:  # the run is over: a server already gone must not fail it
                log.warning("weight group %s: servers not told to leave it (%s)", self._name(), err)
            finally:
                collectives.destroy_group(self.group)
                self.group, self._members = None, []

    def send(self, bucket: list[NamedTensor], version: int) -> None:
        flat, _ = flatten_bucket([(n, t.to(self.device)) for n, t in bucket])
        body = {**distributed_spec(bucket), "group_name": self._name(), "load_format": LOAD_FORMAT,
                "flush_cache": False, "weight_version": str(version)}
        with self.lock, ThreadPoolExecutor(max_workers=1) as pool:
            # The servers block in their receive until the broadcast; post first, then broadcast.
            call = pool.submit(self.engine.broadcast, "/update_weights_from_distributed", body)
            collectives.broadcast(flat, group_src=0, group=self.group)
            call.result()
        self.checked.record(bucket)

    def finish(self, version: int) -> None:
        self.engine.finish_update(version)
        self.engine.resume()

    def checksums(self, names: list[str]) -> dict[str, str]:
        return self.checked.verify(names)
