"""The colocated protocol's waits on 2 real gloo processes, the trigger on ONE rank: rank 0 owns the
servers and is slow to bring their KV cache back (after_sync) or to release it for a save
(trainer_on_device); rank 1 is a client. The client must not generate before the owner's resume has
finished, nor reload its trainer for a save before the owner released the cache (loop/colocated.py).
Each rank records wall-clock times of its own events; same host, so they compare."""

from __future__ import annotations

import pytest

from _launch import run_distributed

SLOW_S = 0.6


def _worker(rank: int, world_size: int) -> dict:
    import time

    import torch.distributed as dist

    from megatron_rl.loop.colocated import ColocatedMemory

    dist.init_process_group("gloo")
    events = []

    class Engine:
        def release_memory(self, tags):
            time.sleep(SLOW_S)
            events.append(("released", tuple(tags), time.time()))

        def resume_memory(self, tags):
            time.sleep(SLOW_S)
            events.append(("resumed", tuple(tags), time.time()))

    class Trainer:
        def offload(self, groups=("grads", "optimizer", "params")):
            return 0

        def reload(self):
            events.append(("reload", (), time.time()))
            return 0

    owner = rank == 0
    # barrier_after_sync is the same on every rank: the job has client ranks (build.py wait_for_owners)
    memory = ColocatedMemory(Trainer(), Engine() if owner else None, True, barrier_after_sync=True,
                             wait_group=dist.group.WORLD)
    memory.begin_training()
    memory.before_sync()
    memory.after_sync()
    events.append(("can_generate", (), time.time()))
    with memory.trainer_on_device():
        events.append(("save", (), time.time()))
    events.append(("after_save", (), time.time()))
    return {"events": events}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, timeout_s=120)


def _at(events, name, tags=()):
    return next(t for n, g, t in events if n == name and (not tags or g == tags))


def test_a_client_generates_only_after_the_owner_resumed_its_kv_cache(ranks):
    owner, client = ranks[0]["events"], ranks[1]["events"]
    assert _at(client, "can_generate") >= _at(owner, "resumed", ("kv_cache", "cuda_graph"))


def test_a_client_reloads_for_a_save_only_after_the_owner_released_its_kv_cache(ranks):
    owner, client = ranks[0]["events"], ranks[1]["events"]
    released = [t for n, g, t in owner if n == "released" and g == ("kv_cache", "cuda_graph")]
    assert len(released) == 1  # the save's release: weights stay
    assert _at(client, "reload") >= released[0]
    # and after the save it generates again only once the owner's cache is back
    back = [t for n, g, t in owner if n == "resumed" and g == ("kv_cache", "cuda_graph")]
    assert len(back) == 2 and _at(client, "after_save") >= back[1]
