"""Checkpoints: Megatron distributed checkpoint (model + optimizer) plus the RL state, saved atomically.

Layout::

    checkpoints/
      latest                    # text: the newest complete step, replaced atomically
      step_000010/
        model/                  # megatron.core.dist_checkpointing (torch_dist), any TP/PP
        rl_state_rank0.pt       # step, data position, RNG states, clip controller, sync version
        hf/                     # config.json + tokenizer: tools/convert_megatron_to_hf.py needs no flags
        ...

A step folder is written as `step_000010.tmp` and renamed only when every rank has finished, so
a kill mid-save leaves the previous checkpoint as the latest one and no folder that looks complete.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path

import torch

from megatron_rl import collectives

log = logging.getLogger("megatron_rl.checkpoint")


def _barrier() -> None:
    collectives.barrier(None)  # every rank of the world (a no-op without torch.distributed)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


class Checkpointer:
    def __init__(self, root: str | Path, hf_dir: str | Path | None = None) -> None:
        self.root = Path(root)
        self.hf_dir = Path(hf_dir) if hf_dir else None

    def _copy_hf_files(self, folder: Path) -> None:
        if self.hf_dir is None:
            return
        (folder / "hf").mkdir()
        for name in HF_FILES:
            if (self.hf_dir / name).is_file():
                shutil.copy2(self.hf_dir / name, folder / "hf" / name)

    def latest_step(self) -> int:
        marker = self.root / "latest"
        return int(marker.read_text().strip()) if marker.exists() else 0

    def _dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def save(self, run, step: int) -> Path:
        """Collective: every rank writes its part; rank 0 publishes the folder atomically."""
        final, tmp = self._dir(step), self._dir(step).with_name(self._dir(step).name + ".tmp")
        rank = run.parallel.rank
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "model").mkdir(parents=True)
        _barrier()
        run.actor.save_checkpoint(tmp / "model")
        torch.save(self._rl_state(run, step), tmp / f"rl_state_rank{rank}.pt")
        _barrier()
        if rank == 0:
            self._copy_hf_files(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            marker_tmp = self.root / "latest.tmp"
            marker_tmp.write_text(str(step))
            os.replace(marker_tmp, self.root / "latest")
            log.info("checkpoint saved: %s", final)
        _barrier()
        return final

    @staticmethod
    def _rl_state(run, step: int) -> dict:
        return {"step": step, "loader": run.loader.state_dict(), "rng": _rng_state(),
                "controller": run.controller.state_dict(), "sync_version": run.sync.version}

    def load_latest(self, run) -> int:
        """Restore model, optimizer and RL state from the latest checkpoint; returns its step."""
        step = self.latest_step()
        if step == 0:
            log.info("no checkpoint under %s: starting from scratch", self.root)
            return 0
        folder = self._dir(step)
        state_path = folder / f"rl_state_rank{run.parallel.rank}.pt"
        if not state_path.exists():
            raise ValueError(f"checkpoint {folder} has no {state_path.name}: was it saved with "
                             f"another number of processes?")
        run.actor.load_checkpoint(folder / "model")
        state = torch.load(state_path, weights_only=True)
        run.loader.load_state_dict(state["loader"])
        run.controller.load_state_dict(state["controller"])
        _set_rng_state(state["rng"])
        run.sync.version = state["sync_version"] - 1  # the start-up sync re-publishes this version
        log.info("resumed from %s (step %d)", folder, step)
        return int(state["step"])
