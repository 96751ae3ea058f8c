"""The colocated memory protocol: the trainer and the rollout engine take turns on the same devices.

One RL step, as train.py runs it (design.md section 10; slime's train.py orders the same calls):

    rollout = generate(...)      # engine: weights + KV cache; trainer: offloaded
    memory.begin_training()      # engine.release_memory(); trainer.reload()
    ...                          # old log-probs; reference_on_device(): reference log-probs;
                                 # BF16 shadow, PPO updates
    memory.before_sync()         # trainer.offload(grads, optimizer); engine.resume_memory(weights)
    sync.sync()                  # trainer parameters -> engine weights
    memory.after_sync()          # trainer.offload(params); engine.resume_memory(kv_cache, cuda_graph)

Tags are explicit both ways: SGLang's release with no tags frees every region, CUDA graphs included
(srt/constants.py GPU_MEMORY_ALL_TYPES, weight_updater.py:343-378), and a resume restores only the
tags it names (weight_updater.py:383-420); graphs left released are replayed on unmapped memory as
soon as SGLANG_MEMORY_SAVER_CUDA_GRAPH puts them in the saver's region. They come back with the KV cache.

The parameters leave the device after the sync, not before it: the export all-gathers TP shards
on the device, and the BF16 parameters are 2 of Megatron's 18 bytes per parameter. The KV cache
comes back last, so the sync never competes with it. With the protocol disabled (disaggregated
engines, or train.colocated_protocol=false) every call is a no-op. The engine exists on the engine rank only; every rank offloads
its own trainer state.
"""

from __future__ import annotations

import contextlib
import time

from megatron_rl import collectives
from megatron_rl.cluster.plan import is_colocated

GB = 1024**3
RELEASE_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang srt/constants.py GPU_MEMORY_TYPE_*
RESUME_AFTER_SYNC = ("kv_cache", "cuda_graph")
SAVE_RELEASE_TAGS = ("kv_cache", "cuda_graph")  # a checkpoint save between steps: weights stay



def protocol_enabled(cfg) -> bool:
    """The memory protocol runs when asked (train.colocated_protocol) and the engine shares the
    trainer's devices (the embedded engine, or SGLang in colocated mode)."""
    return bool(cfg.train.colocated_protocol) and is_colocated(cfg)

class ColocatedMemory:
    """Owns the order of release / offload / resume calls; tracks who holds the device."""

    def __init__(self, actor, engine, enabled: bool, barrier_after_sync: bool = False,
                 reference=None, wait_group=None) -> None:
        self.actor = actor
        self.wait_group = wait_group
        """Gloo group of the whole world with the job's long-wait timeout (collectives.HostGroups.world)."""
        self.engine = engine
        self.enabled = enabled
        self.barrier_after_sync = barrier_after_sync
        """Ranks that sample through servers another rank owns (placement clients) wait here until
        the owner has resumed the KV cache: generating earlier is refused by SGLang."""
        self._engine_released = False
        self._trainer_offloaded = False
        self.reference = reference
        """The frozen reference policy (KL): on the host except inside reference_on_device()."""
        if enabled and reference is not None:
            reference.offload(("params",))  # before the engine starts sampling

    @contextlib.contextmanager
    def reference_on_device(self):
        """The reference's parameters on the device for its forward (after the old log-probs), then
        back to pinned host memory: it never shares the device with the PPO updates or the engine."""
        if not self.enabled or self.reference is None:
            yield
            return
        self.reference.reload()
        try:
            yield
        finally:
            self.reference.offload(("params",))

    def begin_training(self) -> dict[str, float]:
        """Engine out, trainer in (before the old log-probs)."""
        if not self.enabled:
            return {}
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.release_memory(RELEASE_TAGS)
            self._engine_released = True
        reloaded = self.actor.reload() if self._trainer_offloaded else 0
        self._trainer_offloaded = False
        return {"memory/trainer_reloaded_gb": reloaded / GB, "time/memory_release": time.perf_counter() - t0}

    def before_sync(self) -> dict[str, float]:
        """Gradients and optimizer state out, engine weights back (uninitialised until the sync)."""
        if not self.enabled:
            return {}
        t0 = time.perf_counter()
        freed = self.actor.offload(("grads", "optimizer"))
        self._trainer_offloaded = True
        if self.engine is not None and self._engine_released:
            self.engine.resume_memory(("weights",))
        return {"memory/trainer_offloaded_gb": freed / GB, "time/memory_offload": time.perf_counter() - t0}

    def after_sync(self) -> dict[str, float]:
        """Parameters out, engine KV cache back: the engine can generate."""
        if not self.enabled:
            return {}
        t0 = time.perf_counter()
        freed = self.actor.offload(("params",))
        if self.engine is not None and self._engine_released:
            self.engine.resume_memory(RESUME_AFTER_SYNC)
            self._engine_released = False
        if self.barrier_after_sync:
            collectives.barrier(self.wait_group)  # world (gloo): every owner's servers can generate again
        return {"memory/params_offloaded_gb": freed / GB, "time/memory_resume": time.perf_counter() - t0}

    @contextlib.contextmanager
    def trainer_on_device(self):
        """The trainer's state on the device for the block (a checkpoint save), as it was after.

        Between steps the engine holds its weights and KV cache: with the whole trainer back too
        (Qwen3-8B at 2 nodes: ~74 of 79 GiB) a save runs out of memory. The owners release the KV
        cache and graphs first (weights stay: no re-sync), every rank waits for them (gloo world),
        and they come back after the trainer is offloaded again."""
        if not self._trainer_offloaded:
            yield
            return
        if self.engine is not None:
            self.engine.release_memory(SAVE_RELEASE_TAGS)
        collectives.barrier(self.wait_group)  # every owner's servers made room before any reload
        self.actor.reload()
        try:
            yield
        finally:
            self.actor.offload()
            collectives.barrier(self.wait_group)
            if self.engine is not None:
                self.engine.resume_memory(SAVE_RELEASE_TAGS)
            if self.barrier_after_sync:
                collectives.barrier(self.wait_group)  # clients generate only once the KV cache is back
