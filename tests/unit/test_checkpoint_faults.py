"""Checkpoint saves that fail part-way: `latest` keeps naming a complete checkpoint, resume uses it.

One process, the real Checkpointer, loader and clip controller; the trainer is a small stand-in
that writes one file where Megatron's distributed checkpoint would write its folder (the real
trainer is killed mid-save in tests/e2e/test_checkpoint_kill.py). Each failure is injected at one
step of the save: the trainer's write, the RL-state write, the folder rename, the `latest` rename.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algo.calibrated_clip import CalibratedClipController
from megatron_rl.data.loader import PromptLoader
from megatron_rl.loop import checkpoint as ckpt_mod
from megatron_rl.loop.checkpoint import Checkpointer

pytestmark = pytest.mark.timeout(60)


class _Schedule:
    """Stands in for the actor's learning-rate scheduler: its state rides in rl_state.pt."""

    def __init__(self) -> None:
        self.num_steps = 0

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]


def _write_weights(weights: torch.Tensor, path: Path) -> None:
    torch.save(weights, path)


class _Trainer:
    """Stands in for the Megatron actor: its 'weights' are one tensor, saved as one file."""

    def __init__(self, value: float) -> None:
        self.weights = torch.full((3,), value)
        self.fail_save = False
        self.scheduler = _Schedule()

    def save_checkpoint(self, folder: Path, *, async_save: bool = False):
        assert folder.is_dir() and not any(folder.iterdir()), "the trainer writes into an empty folder"
        if self.fail_save:
            raise OSError("disk full")
        if async_save:  # Megatron's own request type, scheduled by the checkpointer on its queue
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

            return AsyncRequest(_write_weights, (self.weights.clone(), folder / "weights.pt"), [])
        _write_weights(self.weights, folder / "weights.pt")
        return None

    def load_checkpoint(self, folder: Path) -> None:
        self.weights = torch.load(folder / "weights.pt", weights_only=True)


def _run(value: float = 0.0, *, rank: int = 0, world_size: int = 1):
    dataset = [f"prompt {i}" for i in range(10)]
    controller = CalibratedClipController(eps_low=0.2, eps_high=0.28, period=2)
    return SimpleNamespace(actor=_Trainer(value), loader=PromptLoader(dataset, batch_size=3, seed=7),
                           controller=controller, sync=SimpleNamespace(version=1),
                           parallel=SimpleNamespace(rank=rank, world_size=world_size))


def _advance(run, value: float, version: int, batches: int = 1) -> None:
    """What a trained step changes: weights, data cursor, controller bounds, sync version."""
    run.actor.weights = torch.full((3,), value)
    for _ in range(batches):
        run.loader.next_batch()
    run.controller.low, run.controller.high = 0.8 - value / 100, 1.3 + value / 100
    run.sync.version = version


def _state(run) -> dict:
    return {"weights": run.actor.weights.tolist(), "loader": run.loader.state_dict(),
            "bounds": (run.controller.low, run.controller.high), "version": run.sync.version}


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def saved(tmp_path):
    """A run checkpointed at step 1 (weights 1.0, one batch drawn, sync version 2), then advanced
    to step 2's state in memory; returns (checkpointer, run, the state saved at step 1)."""
    ckpt, run = Checkpointer(tmp_path / "ckpt"), _run()
    _advance(run, 1.0, version=2)
    ckpt.save(run, 1)
    at_step1 = _state(run)
    _advance(run, 2.0, version=3)
    return ckpt, run, at_step1


def _resume(ckpt: Checkpointer) -> tuple[int, dict]:
    fresh = _run(value=-1.0)
    step = ckpt.load_latest(fresh)
    fresh.sync.version += 1  # the start-up sync re-publishes the saved version
    return step, _state(fresh)


def test_a_complete_save_is_published_and_restores_everything(saved):
    ckpt, run, at_step1 = saved
    ckpt.save(run, 2)
    assert _names(ckpt.root) == ["latest", "step_000001", "step_000002"]
    assert (ckpt.root / "latest").read_text() == "2"
    assert sorted(p.name for p in (ckpt.root / "step_000002").iterdir()) == ["model", "rl_state.pt"]
    step, state = _resume(ckpt)
    assert step == 2 and state == _state(run)
    assert state != at_step1


def _fail_os_replace(monkeypatch, target_name: str) -> None:
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == target_name:
            raise OSError(f"injected: rename to {target_name}")
        return real(src, dst)
    monkeypatch.setattr(ckpt_mod.os, "replace", replace)


@pytest.mark.parametrize("where", ["trainer_write", "rl_state_write", "folder_rename", "latest_rename"])
def test_a_save_that_fails_part_way_leaves_the_previous_checkpoint_latest(saved, monkeypatch, where):
    ckpt, run, at_step1 = saved
    if where == "trainer_write":
        run.actor.fail_save = True
    elif where == "rl_state_write":
        real_save = torch.save

        def save(obj, f, *a, **k):
            if Path(f).name == "rl_state.pt":
                raise OSError("injected: rl_state write")
            return real_save(obj, f, *a, **k)
        monkeypatch.setattr(ckpt_mod.torch, "save", save)
    elif where == "folder_rename":
        _fail_os_replace(monkeypatch, "step_000002")
    else:
        _fail_os_replace(monkeypatch, "latest")
    with pytest.raises(OSError, match="injected|disk full"):
        ckpt.save(run, 2)
    assert (ckpt.root / "latest").read_text() == "1"
    step, state = _resume(ckpt)
    assert step == 1 and state == at_step1
    # nothing that looks like a complete step 2 unless it was fully written (only the marker failed)
    if where != "latest_rename":
        assert not (ckpt.root / "step_000002").exists()
    # the run goes on: the next save of the same step succeeds and is the latest
    monkeypatch.undo()
    run.actor.fail_save = False
    ckpt.save(run, 2)
    assert (ckpt.root / "latest").read_text() == "2"
    assert not [n for n in _names(ckpt.root) if n.endswith(".tmp")]
    assert _resume(ckpt) == (2, _state(run))


def test_a_leftover_tmp_folder_is_replaced_not_merged(saved):
    ckpt, run, _ = saved
    stale = ckpt.root / "step_000002.tmp" / "model"
    stale.mkdir(parents=True)
    (stale / "stale_shard").write_text("from a killed save")
    ckpt.save(run, 2)
    assert sorted(p.name for p in (ckpt.root / "step_000002" / "model").iterdir()) == ["weights.pt"]


def test_a_step_folder_without_rl_state_is_refused(saved):
    ckpt, run, _ = saved
    os.remove(ckpt.root / "step_000001" / "rl_state.pt")
    with pytest.raises(ValueError, match="no rl_state.pt"):
        ckpt.load_latest(_run())


def test_no_checkpoint_starts_from_scratch(tmp_path):
    run = _run(value=5.0)
    before = _state(run)
    assert Checkpointer(tmp_path / "none").load_latest(run) == 0
    assert _state(run) == before


def test_rng_is_restored_per_rank_and_falls_back_to_rank0(tmp_path):
    """rl_state.pt keeps every rank's RNG in rank order; a resumed rank takes its own, or rank 0's
    when the saved run had fewer ranks."""
    ckpt, run = Checkpointer(tmp_path / "ckpt"), _run()
    torch.manual_seed(11)
    random.seed(11)
    ckpt.save(run, 1)
    expected = (torch.rand(4).tolist(), random.random())
    rngs = torch.load(ckpt.root / "step_000001" / "rl_state.pt", weights_only=True)["rng"]
    assert len(rngs) == 1
    for rank, world_size in ((0, 1), (1, 2)):  # rank 1 of 2: no saved RNG of its own
        torch.manual_seed(99)
        random.seed(99)
        ckpt.load_latest(_run(rank=rank, world_size=world_size))
        assert (torch.rand(4).tolist(), random.random()) == expected
    state = ckpt._load_rl_state(ckpt.root / "step_000001", SimpleNamespace(rank=0, world_size=1))
    assert state["step"] == 1 and state["sync_version"] == 1


def test_ranks_beyond_the_saved_ones_take_rank0s_rng_not_a_wrapped_one(tmp_path):
    """Saved on 2 ranks, resumed on 4: ranks 0 and 1 take their own RNG, ranks 2 and 3 rank 0's
    (rank 3 would take rank 1's under a modulo); resumed on 1: rank 0's."""
    folder = tmp_path / "step_000003"
    folder.mkdir()
    torch.save({"step": 3, "rng": [torch.tensor([10]), torch.tensor([11])]}, folder / "rl_state.pt")
    got = {(world, rank): int(Checkpointer._load_rl_state(folder, SimpleNamespace(rank=rank, world_size=world))["rng"])
           for world in (1, 2, 4) for rank in range(world)}
    assert got == {(1, 0): 10, (2, 0): 10, (2, 1): 11, (4, 0): 10, (4, 1): 11, (4, 2): 10, (4, 3): 10}


def test_hf_files_are_copied_into_the_step_folder(tmp_path):
    hf = tmp_path / "hf_src"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    (hf / "unrelated.bin").write_text("x")
    ckpt = Checkpointer(tmp_path / "ckpt", hf_dir=hf)
    ckpt.save(_run(), 3)
    assert _names(ckpt.root / "step_000003" / "hf") == ["config.json", "tokenizer.json"]
    assert ckpt.latest_step() == 3


def test_rng_of_each_saved_rank_goes_back_to_that_rank(tmp_path):
    """A 2-rank rl_state.pt (written as the checkpointer writes it): rank 1 takes rank 1's RNG."""
    ckpt, run = Checkpointer(tmp_path / "ckpt"), _run()
    ckpt.save(run, 1)
    path = ckpt.root / "step_000001" / "rl_state.pt"
    state = torch.load(path, weights_only=True)
    torch.manual_seed(5)
    rank1 = {"torch": torch.get_rng_state(), "python": random.getstate()}
    state["rng"] = [state["rng"][0], rank1]
    torch.save(state, path)
    expected = torch.rand(4).tolist()
    ckpt.load_latest(_run(rank=1, world_size=2))
    assert torch.rand(4).tolist() == expected


def test_the_older_per_rank_layout_is_read(tmp_path):
    """rl_state_rank<r>.pt (one file per rank, same world size) from earlier releases."""
    ckpt, run = Checkpointer(tmp_path / "ckpt"), _run()
    _advance(run, 3.0, version=4, batches=2)
    ckpt.save(run, 1)
    folder = ckpt.root / "step_000001"
    state = torch.load(folder / "rl_state.pt", weights_only=True)
    state["rng"] = state["rng"][0]
    torch.save(state, folder / "rl_state_rank0.pt")
    os.remove(folder / "rl_state.pt")
    assert _resume(ckpt) == (1, _state(run))


def test_an_async_save_is_published_only_when_its_write_has_finished(tmp_path, single_parallel):
    """Megatron's AsyncCallsQueue (a 1-process gloo group: it gathers write results) publishes the
    folder in the finalize step."""
    ckpt, run = Checkpointer(tmp_path / "ckpt", async_save=True), _run()
    _advance(run, 1.0, version=2)
    ckpt.save(run, 1)
    ckpt.wait()
    assert ckpt.latest_step() == 1 and _resume(ckpt) == (1, _state(run))
    _advance(run, 2.0, version=3)
    ckpt.save(run, 2)  # waits for nothing in flight, schedules step 2
    ckpt.wait()
    assert _names(ckpt.root) == ["latest", "step_000001", "step_000002"]
    assert _resume(ckpt) == (2, _state(run))


def test_a_save_is_synchronous_unless_asked(tmp_path):
    ckpt, run = Checkpointer(tmp_path / "ckpt"), _run()
    ckpt.save(run, 1)  # no wait(): published on return
    assert ckpt.latest_step() == 1
