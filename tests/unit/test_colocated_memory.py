"""ColocatedMemory on its own: who is called, in which order, with which tags, on owner and client
ranks, with the protocol off, around a reference forward and a checkpoint save (also when the block
raises), and the metrics it reports. The loop-level order is tests/e2e/test_colocated.py."""

from __future__ import annotations

import pytest

from megatron_rl.loop import colocated
from megatron_rl.loop.colocated import GB, ColocatedMemory

pytestmark = pytest.mark.timeout(30)

GROUP = object()  # stands for the gloo world group; only its identity is checked


class _Log:
    def __init__(self):
        self.calls: list[tuple] = []


class _Actor:
    """Offload returns the bytes freed per group, reload the bytes brought back (as MegatronActor)."""

    BYTES = {"grads": 1 * GB, "optimizer": 4 * GB, "params": 2 * GB}

    def __init__(self, log: _Log, name: str = "actor"):
        self.log, self.name, self.held = log, name, 0

    def offload(self, groups=("grads", "optimizer", "params")):
        self.log.calls.append((self.name, "offload", tuple(groups)))
        freed = sum(self.BYTES[g] for g in groups)
        self.held += freed
        return freed

    def reload(self):
        self.log.calls.append((self.name, "reload"))
        back, self.held = self.held, 0
        return back


class _Engine:
    def __init__(self, log: _Log):
        self.log = log

    def release_memory(self, tags):
        self.log.calls.append(("engine", "release", tuple(tags)))

    def resume_memory(self, tags):
        self.log.calls.append(("engine", "resume", tuple(tags)))


@pytest.fixture
def log(monkeypatch) -> _Log:
    log = _Log()
    monkeypatch.setattr(colocated.collectives, "barrier", lambda group: log.calls.append(("barrier", group)))
    return log


def _memory(log, *, owner=True, enabled=True, barrier_after_sync=False, reference=None):
    return ColocatedMemory(_Actor(log), _Engine(log) if owner else None, enabled,
                           barrier_after_sync=barrier_after_sync, reference=reference, wait_group=GROUP)


def _step(memory):
    return memory.begin_training(), memory.before_sync(), memory.after_sync()


def test_an_owner_rank_takes_turns_with_its_engine_and_reports_the_bytes(log):
    memory = _memory(log)
    assert log.calls == []
    first = _step(memory)
    second = _step(memory)
    one_step = [("engine", "release", ("weights", "kv_cache", "cuda_graph")),
                ("actor", "offload", ("grads", "optimizer")), ("engine", "resume", ("weights",)),
                ("actor", "offload", ("params",)), ("engine", "resume", ("kv_cache", "cuda_graph"))]
    # the first step's trainer is on the device already; from the second on it comes back first
    assert log.calls == one_step + one_step[:1] + [("actor", "reload")] + one_step[1:]
    assert first[0]["memory/trainer_reloaded_gb"] == 0.0 and second[0]["memory/trainer_reloaded_gb"] == 7.0
    for begin, before, after in (first, second):
        assert sorted(begin) == ["memory/trainer_reloaded_gb", "time/memory_release"]
        assert before["memory/trainer_offloaded_gb"] == 5.0 and after["memory/params_offloaded_gb"] == 2.0
        assert sorted(before) == ["memory/trainer_offloaded_gb", "time/memory_offload"]
        assert sorted(after) == ["memory/params_offloaded_gb", "time/memory_resume"]
        assert all(0.0 <= m[k] < 1.0 for m in (begin, before, after) for k in m if k.startswith("time/"))


def test_a_client_rank_moves_only_its_trainer_and_waits_for_the_owners(log):
    memory = _memory(log, owner=False, barrier_after_sync=True)
    _step(memory)
    _step(memory)
    one = [("actor", "offload", ("grads", "optimizer")), ("actor", "offload", ("params",)), ("barrier", GROUP)]
    assert log.calls == one + [("actor", "reload")] + one


def test_the_engine_gets_its_weights_back_only_after_it_released_them(log):
    memory = _memory(log, barrier_after_sync=True)
    memory.before_sync()  # the start-up sync: nothing was released
    memory.after_sync()
    assert log.calls == [("actor", "offload", ("grads", "optimizer")), ("actor", "offload", ("params",)),
                         ("barrier", GROUP)]
    log.calls.clear()
    _step(memory)
    assert [c for c in log.calls if c[0] == "engine"] == [
        ("engine", "release", ("weights", "kv_cache", "cuda_graph")), ("engine", "resume", ("weights",)),
        ("engine", "resume", ("kv_cache", "cuda_graph"))]
    log.calls.clear()
    memory.after_sync()  # a second after_sync resumes nothing more
    assert log.calls == [("actor", "offload", ("params",)), ("barrier", GROUP)]


def test_off_nothing_moves_and_nothing_is_reported(log):
    reference = _Actor(log, "reference")
    memory = _memory(log, enabled=False, barrier_after_sync=True, reference=reference)
    assert _step(memory) == ({}, {}, {})
    with memory.reference_on_device():
        pass
    with memory.trainer_on_device():
        pass
    assert log.calls == []


def test_the_reference_is_on_the_device_only_for_its_forward(log):
    reference = _Actor(log, "reference")
    memory = _memory(log, reference=reference)
    assert log.calls == [("reference", "offload", ("params",))]  # at construction, before any rollout
    log.calls.clear()
    with memory.reference_on_device():
        log.calls.append(("forward",))
    with pytest.raises(KeyError):
        with memory.reference_on_device():
            raise KeyError("a failed forward")
    back = [("reference", "reload"), ("reference", "offload", ("params",))]
    assert log.calls == [back[0], ("forward",), back[1], *back]
    log.calls.clear()
    with _memory(log).reference_on_device():  # no reference: nothing to move
        pass
    assert log.calls == []


def test_a_save_between_steps_brings_the_trainer_back_around_the_kv_cache(log):
    memory = _memory(log, barrier_after_sync=True)
    with memory.trainer_on_device():  # the trainer is on the device (start, or inside a step)
        log.calls.append(("save",))
    assert log.calls == [("save",)]
    _step(memory)
    log.calls.clear()
    with pytest.raises(OSError):
        with memory.trainer_on_device():
            log.calls.append(("save",))
            raise OSError("disk full")
    assert log.calls == [("engine", "release", ("kv_cache", "cuda_graph")), ("barrier", GROUP), ("actor", "reload"),
                         ("save",), ("actor", "offload", ("grads", "optimizer", "params")), ("barrier", GROUP),
                         ("engine", "resume", ("kv_cache", "cuda_graph")), ("barrier", GROUP)]
    log.calls.clear()
    memory.begin_training()  # the next step finds the trainer offloaded again
    assert log.calls[1] == ("actor", "reload")


def test_a_save_on_a_client_rank_without_the_barrier_after_sync(log):
    memory = _memory(log, owner=False)
    _step(memory)
    log.calls.clear()
    with memory.trainer_on_device():
        log.calls.append(("save",))
    assert log.calls == [("barrier", GROUP), ("actor", "reload"), ("save",),
                         ("actor", "offload", ("grads", "optimizer", "params")), ("barrier", GROUP)]


def test_inside_a_step_the_trainer_is_on_the_device_and_a_save_moves_nothing(log):
    memory = _memory(log)
    _step(memory)
    memory.begin_training()  # engine out, trainer back in
    log.calls.clear()
    with memory.trainer_on_device():
        log.calls.append(("save",))
    assert log.calls == [("save",)]
