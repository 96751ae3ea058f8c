"""Value tests of the colocated decisions train.py takes on CPU: for every crossing of (the rollout
kept a batch) x (prepare kept it: no non-finite old log-prob) x (the protocol is on), which of
release / update / LR step / sync run in one step (a released engine lost its weights: even a
skipped update syncs them back), the lr logged being the one the update used, and when the
protocol is on at all (train.colocated_protocol x engine x SGLang mode). The truth table is by hand."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from megatron_rl import train
from megatron_rl.config import load_config
from megatron_rl.loop import phases
from megatron_rl.loop.colocated import ColocatedMemory, protocol_enabled

GB = 1024**3


class _Trainer:
    def __init__(self, calls):
        self.calls, self.lr = calls, 0.5

    def offload(self, groups=("grads", "optimizer", "params")):
        self.calls.append(("offload", tuple(groups)))
        return GB

    def reload(self):
        self.calls.append(("reload",))
        return 3 * GB

    def advance_lr_schedule(self):
        self.calls.append(("lr_step",))
        self.lr /= 2


class _Engine:
    def __init__(self, calls):
        self.calls = calls

    def release_memory(self, tags):
        self.calls.append(("release", tuple(tags)))

    def resume_memory(self, tags):
        self.calls.append(("resume", tuple(tags)))


def _one_step(monkeypatch, rolled: bool, kept: bool, enabled: bool, step_before: bool):
    calls = []
    trainer = _Trainer(calls)
    memory = ColocatedMemory(trainer, _Engine(calls), enabled)
    if step_before:  # a previous step left the trainer offloaded
        memory.before_sync()
        memory.after_sync()
        calls.clear()
    seen_lr = []
    rollout = phases.Rollout({"rows": 1} if rolled else None, {"step/skipped": float(not rolled)})
    monkeypatch.setattr(phases, "generate", lambda run, prompts, step: rollout)
    monkeypatch.setattr(phases, "prepare", lambda run, batch, step, metrics, memory=None: batch if kept else None)

    def update(run, batch, step):
        calls.append(("update",))
        seen_lr.append(trainer.lr)
        return {"loss": 1.0}
    monkeypatch.setattr(phases, "update_policy", update)
    run = SimpleNamespace(loader=SimpleNamespace(next_batch=lambda: []), actor=trainer,
                          sync=SimpleNamespace(sync=lambda: calls.append(("sync",)) or {"sync/version": 1.0}))
    metrics = train._step(run, 4, memory)
    return calls, metrics, seen_lr


@pytest.mark.parametrize("rolled, kept, enabled, step_before",
                         [c for c in itertools.product([True, False], repeat=4) if c[0] or not c[1]])
def test_what_one_step_runs_for_each_crossing(monkeypatch, rolled, kept, enabled, step_before):
    calls, metrics, seen_lr = _one_step(monkeypatch, rolled, kept, enabled, step_before)
    trained = rolled and kept
    expected = []
    if rolled and enabled:
        expected.append(("release", ("weights", "kv_cache", "cuda_graph")))
        if step_before:
            expected.append(("reload",))
    if trained:
        expected += [("update",), ("lr_step",)]
    if trained or (rolled and enabled):
        if enabled:
            expected += [("offload", ("grads", "optimizer")), ("resume", ("weights",))]
        expected.append(("sync",))
        if enabled:
            expected += [("offload", ("params",)), ("resume", ("kv_cache", "cuda_graph"))]
    assert calls == expected
    assert metrics["lr"] == 0.5 and seen_lr == ([0.5] if trained else [])  # the lr the update used, logged
    assert ("sync/version" in metrics) == (trained or (rolled and enabled))
    if rolled and enabled:
        assert metrics["memory/trainer_reloaded_gb"] == (3.0 if step_before else 0.0)
        assert metrics["memory/trainer_offloaded_gb"] == 1.0 and metrics["memory/params_offloaded_gb"] == 1.0
    else:
        assert not [k for k in metrics if k.startswith("memory/")]


@pytest.mark.parametrize("protocol, engine, mode, on", [
    (True, "torch", "colocated", True), (True, "torch", "disaggregated", True),
    (True, "sglang", "colocated", True), (True, "sglang", "disaggregated", False),
    (False, "torch", "colocated", False), (False, "sglang", "colocated", False)])
def test_the_protocol_is_on_for_colocated_engines_when_asked(protocol, engine, mode, on):
    cfg = load_config(None, [f"train.colocated_protocol={str(protocol).lower()}", f"rollout.engine={engine}",
                             f"rollout.sglang.mode={mode}",
                             f"rollout.sglang.weight_transport={'tensor' if mode == 'colocated' else 'nccl'}"])
    assert protocol_enabled(cfg) is on  # what train.run hands ColocatedMemory


def test_train_run_hands_the_memory_protocol_the_configured_switch(monkeypatch, tmp_path):
    """train.run builds ColocatedMemory with protocol_enabled(cfg): off when train.colocated_protocol
    is false even for the embedded (colocated) engine, on when true."""
    from megatron_rl import train
    from megatron_rl.loop import build

    seen = []

    class Stop(Exception):
        pass

    def memory(actor, owned, *, enabled, **kw):
        seen.append(enabled)
        raise Stop
    fake_run = SimpleNamespace(engine=None, sync=SimpleNamespace(transport=None, wait_for_owners=False, wait_group=None),
                               actor=None, ref=None)
    monkeypatch.setattr(build, "build_run", lambda cfg: fake_run)
    monkeypatch.setattr(train, "ColocatedMemory", memory)
    for flag in (False, True):
        cfg = load_config(None, [f"train.colocated_protocol={str(flag).lower()}", "rollout.engine=torch",
                                 f"log.dir={tmp_path / str(flag)}"])
        with pytest.raises(Stop):
            train.run(cfg)
    assert seen == [False, True]
