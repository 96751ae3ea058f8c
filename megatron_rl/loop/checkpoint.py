"""Checkpoints: Megatron distributed checkpoint (model + optimizer) plus the RL state, saved atomically.

Layout::

    checkpoints/
      latest                    # text: the newest complete step, replaced atomically
      best, best.json           # checkpoint.keep_best: the best-scoring checkpointed step, its score (loop/best.py)
      step_000010/
        model/                  # megatron.core.dist_checkpointing (torch_dist), any TP/PP/DP
        rl_state.pt             # step, data position, clip controller, sync version, lr schedule, RNG per rank
        hf/                     # config.json + tokenizer: tools/convert_megatron_to_hf.py needs no flags
        ...

A step folder is written as `step_000010.tmp` and renamed only when every rank has finished, so
a kill mid-save leaves the previous checkpoint as the latest one and no folder that looks complete.

Retention (checkpoint.keep_last = N > 0): after each publish, rank 0 deletes complete step folders
older than the N newest. Never deleted: a `.tmp` folder (being written, or left by a kill), the
folder `latest` names, and the folder a `best` file names (written by evaluation, like `latest`).

The RL state does not depend on the world size (the loader, controller and sync version are the
same on every rank; each rank's RNG state is kept by rank), so a run resumes at another DP size:
there each rank restores the RNG of the same rank if the saved run had one, else rank 0's.

Async save (checkpoint.async_save): the model folder is written by a background process; the
rename and the `latest` marker happen when it has finished on every rank. `wait()` blocks until
then; save() calls it first (one save in flight at most), as must anything that frees or moves
the trainer's memory (offload) and the end of the run.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path

import torch

from megatron_rl import collectives

log = logging.getLogger("megatron_rl.loop.checkpoint")


def _barrier() -> None:
    collectives.barrier(None)  # every rank of the world (a no-op without torch.distributed)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def write_marker(path: Path, text: str) -> None:
    """Replace the file `path` atomically (a reader sees the old text or the new, never a part)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


class Checkpointer:
    def __init__(self, root: str | Path, hf_dir: str | Path | None = None, *,
                 async_save: bool = False, keep_last: int = 0) -> None:
        self.root = Path(root)
        self.hf_dir = Path(hf_dir) if hf_dir else None
        self.async_save = async_save
        self.keep_last = keep_last
        self._queue = None  # megatron AsyncCallsQueue, made at the first async save

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
        """Collective: every rank writes its part; rank 0 publishes the folder atomically (at
        once, or when the background write of an async save has finished everywhere)."""
        self.wait()
        final, tmp = self._dir(step), self._dir(step).with_name(self._dir(step).name + ".tmp")
        rank = run.parallel.rank
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "model").mkdir(parents=True)
        _barrier()
        request = run.actor.save_checkpoint(tmp / "model", async_save=self.async_save)
        rngs = collectives.gather_objects(_rng_state(), 0, None)  # every rank's, in rank order
        if rank == 0:
            torch.save(self._rl_state(run, step, rngs), tmp / "rl_state.pt")
        if request is None:
            _barrier()
            self._publish(rank, step)
            return final
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        # Megatron's finalize (metadata, after gathering every rank's write results) runs first,
        # then the publish, on every rank (async_utils.py:574-609).
        request.add_finalize_fn(lambda: self._publish(rank, step))
        self._queue = self._queue or AsyncCallsQueue()
        self._queue.schedule_async_request(request)
        return final

    def wait(self) -> None:
        """Finish (and publish) an async save in flight; collective, a no-op when none is."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=True)

    def _publish(self, rank: int, step: int) -> None:
        final, tmp = self._dir(step), self._dir(step).with_name(self._dir(step).name + ".tmp")
        _barrier()
        if rank == 0:
            self._copy_hf_files(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            write_marker(self.root / "latest", str(step))
            log.info("checkpoint saved: %s", final)
            if self.keep_last:
                self.prune()
        _barrier()

    def complete_steps(self) -> list[int]:
        """Steps with a published folder (renamed from .tmp, holding rl_state.pt), ascending. Only the
        folder this class names a step (`step_000010`) counts: `step_10` is not what load_latest reads,
        and counting both would make prune delete the one folder twice."""
        steps = []
        for folder in self.root.glob("step_*"):
            suffix = folder.name.removeprefix("step_")
            if suffix.isdigit() and folder.name == self._dir(int(suffix)).name and (folder / "rl_state.pt").exists():
                steps.append(int(suffix))
        return sorted(steps)

    def _marked_step(self, name: str) -> int | None:
        """The step a marker file (`latest`, `best`) names: a step number or a step folder's name."""
        marker = self.root / name
        if not marker.exists():
            return None
        text = marker.read_text().strip().rstrip("/").rsplit("/", 1)[-1].removeprefix("step_")
        return int(text) if text.isdigit() else None

    def prune(self) -> list[int]:
        """Delete complete checkpoints beyond the keep_last newest, sparing `latest` and `best`
        (and every .tmp folder); returns the deleted steps. Rank 0 only."""
        steps = self.complete_steps()
        keep = set(steps[-self.keep_last:]) | {self._marked_step("latest"), self._marked_step("best")}
        doomed = [s for s in steps if s not in keep]
        for step in doomed:
            # Renamed out of the step_* pattern first: a kill mid-delete leaves no half checkpoint
            # that looks complete.
            trash = self.root / f".deleting_{step:06d}"
            os.replace(self._dir(step), trash)
            shutil.rmtree(trash, ignore_errors=True)
        if doomed:
            log.info("checkpoint.keep_last=%d: deleted steps %s", self.keep_last, doomed)
        return doomed

    @staticmethod
    def _rl_state(run, step: int, rngs: list) -> dict:
        return {"step": step, "loader": run.loader.state_dict(), "rng": rngs,
                "controller": run.controller.state_dict(), "sync_version": run.sync.version,
                "lr_scheduler": run.actor.scheduler.state_dict()}

    @staticmethod
    def _load_rl_state(folder: Path, parallel) -> dict:
        """The RL state with `rng` resolved to this rank's (rank 0's where the saved run had
        fewer ranks). Also reads the older per-rank layout (rl_state_rank<r>.pt, same world size)."""
        path, legacy = folder / "rl_state.pt", folder / f"rl_state_rank{parallel.rank}.pt"
        if not path.exists() and legacy.exists():
            return torch.load(legacy, weights_only=True)
        if not path.exists():
            raise ValueError(f"checkpoint {folder} has no rl_state.pt: not a complete checkpoint")
        state = torch.load(path, weights_only=True)
        rngs = state["rng"]
        if len(rngs) != parallel.world_size:
            log.info("resuming %d saved ranks on %d: ranks without a saved RNG take rank 0's",
                     len(rngs), parallel.world_size)
        state["rng"] = rngs[parallel.rank] if parallel.rank < len(rngs) else rngs[0]
        return state

    def load_latest(self, run) -> int:
        """Restore model, optimizer and RL state from the latest checkpoint; returns its step."""
        step = self.latest_step()
        if step == 0:
            log.info("no checkpoint under %s: starting from scratch", self.root)
            return 0
        folder = self._dir(step)
        state = self._load_rl_state(folder, run.parallel)
        run.actor.load_checkpoint(folder / "model")
        run.loader.load_state_dict(state["loader"])
        run.controller.load_state_dict(state["controller"])
        if "lr_scheduler" in state:  # older checkpoints: the schedule restarts
            run.actor.scheduler.load_state_dict(state["lr_scheduler"])
        _set_rng_state(state["rng"])
        run.sync.version = state["sync_version"] - 1  # the start-up sync re-publishes this version
        log.info("resumed from %s (step %d)", folder, step)
        return int(state["step"])
