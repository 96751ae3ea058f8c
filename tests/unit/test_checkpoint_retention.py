"""checkpoint.keep_last: only older complete checkpoints are deleted; never the one being written (or
left by a kill mid-save), the one `latest` names, or the one `best` names."""

import multiprocessing as mp
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.config import load_config
from megatron_rl.loop.checkpoint import Checkpointer


class _Actor:
    def __init__(self, die: bool = False):
        self.die = die
        self.scheduler = SimpleNamespace(state_dict=lambda: {"num_steps": 0})

    def save_checkpoint(self, folder: Path, async_save: bool = False):
        (folder / "shard.bin").write_bytes(b"x" * 16)
        if self.die:
            os._exit(137)  # killed mid-save: the model is half written, nothing is published
        return None


def _run(die: bool = False):
    return SimpleNamespace(parallel=SimpleNamespace(rank=0), actor=_Actor(die),
                           loader=SimpleNamespace(state_dict=lambda: {"position": 0}),
                           controller=SimpleNamespace(state_dict=lambda: {}), sync=SimpleNamespace(version=1))


def _on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def _killed_save(root: Path, step: int) -> None:
    Checkpointer(root, keep_last=1).save(_run(die=True), step)


def test_keep_last_spares_latest_best_and_a_killed_save(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, keep_last=2)
    for step in (10, 20):
        ckpt.save(_run(), step)
    assert _on_disk(root) == ["step_000010", "step_000020"]
    ckpt.save(_run(), 30)
    assert _on_disk(root) == ["step_000020", "step_000030"]
    (root / "best").write_text("20")
    ckpt.save(_run(), 40)
    assert _on_disk(root) == ["step_000020", "step_000030", "step_000040"]  # 20 is the best

    child = mp.get_context("fork").Process(target=_killed_save, args=(root, 50))
    child.start()
    child.join()
    assert child.exitcode == 137
    assert (root / "latest").read_text() == "40" and (root / "step_000050.tmp" / "model" / "shard.bin").exists()
    assert ckpt.complete_steps() == [20, 30, 40]

    resumed = Checkpointer(root, keep_last=1)  # the requeued run
    resumed.save(_run(), 60)
    assert _on_disk(root) == ["step_000020", "step_000050.tmp", "step_000060"]
    assert (root / "latest").read_text() == "60"


def test_latest_named_older_is_spared(tmp_path):
    root = tmp_path / "c"
    ckpt = Checkpointer(root, keep_last=1)
    for step in (1, 2, 3):
        ckpt.save(_run(), step)
    (root / "latest").write_text("3")
    (root / "best").write_text("step_000003\n")
    assert ckpt.prune() == []
    assert _on_disk(root) == ["step_000003"]
    keep_all = Checkpointer(root)
    for step in (4, 5):
        keep_all.save(_run(), step)
    assert _on_disk(root) == ["step_000003", "step_000004", "step_000005"]


def test_bad_retention_values():
    for key in ("keep_last", "save_hf_every"):
        with pytest.raises(ValueError, match=f"config key 'checkpoint.{key}'"):
            load_config(None, [f"checkpoint.{key}=-1"])
