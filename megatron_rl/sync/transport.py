"""Weight transports: how buckets of HF-named tensors reach a rollout engine.

Ordering contract, the same for every strategy::

    transport.begin(version)              # engine pauses generation (in-flight requests finish)
    for bucket in buckets:                # buckets arrive in order; a weight and its scale share one
        transport.send(bucket, version)
    transport.finish(version)             # engine flushes caches, adopts `version`, resumes
    transport.checksums(names)            # optional check mode: digests of what the engine holds

Strategies: `InProcessTransport` (the embedded torch engine, same process). SGLang tensor / NCCL
and disk transports implement the same four calls.
"""

from __future__ import annotations

from typing import Protocol

from megatron_rl.rollout.base import tensor_digest  # noqa: F401  (re-exported: one recipe for both sides)
from megatron_rl.sync.buckets import NamedTensor


class WeightTransport(Protocol):
    def begin(self, version: int) -> None: ...
    def send(self, bucket: list[NamedTensor], version: int) -> None: ...
    def finish(self, version: int) -> None: ...
    def checksums(self, names: list[str]) -> dict[str, str]: ...


class InProcessTransport:
    """Hands buckets to an engine living in this process (`megatron_rl.rollout.TorchRolloutEngine`).

    Tensors are cloned on the way in so the engine never aliases trainer memory: the trainer's
    next optimizer step must not change what the engine serves.
    """

    def __init__(self, engine) -> None:
        self.engine = engine

    def begin(self, version: int) -> None:
        self.engine.pause()

    def send(self, bucket: list[NamedTensor], version: int) -> None:
        self.engine.update_weights([(n, t.detach().clone()) for n, t in bucket], version)

    def finish(self, version: int) -> None:
        self.engine.finish_update(version)
        self.engine.resume()

    def checksums(self, names: list[str]) -> dict[str, str]:
        return self.engine.checksum(names)
