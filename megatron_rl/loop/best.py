"""checkpoint.keep_best: which checkpointed step scored best on an eval metric, kept in `best` next to `latest`."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from megatron_rl.loop.checkpoint import write_marker

log = logging.getLogger("megatron_rl.loop.best")


class BestCheckpoint:
    """Pairs eval scores with checkpoints of the same weights; rank 0 writes, every rank may call.

    An evaluation at the top of step s scores the weights of checkpoint step_s (saved at the end of
    step s - 1); the at_end evaluation scores the weights of the final checkpoint, saved after it.
    So a score waits until its checkpoint exists (`scored` then `saved`, or `saved` then `scored`).
    `best.json` ({"step", "metric", "value"}, and "source" when given) is written before `best` (the
    step, as `latest`), both atomically: a resumed run continues the comparison from it when it
    measures the same metric on the same `source` (the eval set's settings: a set of the same name
    with other problems or sampling gives scores that do not compare). Higher is better.
    """

    def __init__(self, root: str | Path, metric: str, enabled: bool = True, source: dict | None = None) -> None:
        self.root = Path(root)
        self.metric = metric
        self.key = f"eval/{metric}"
        self.enabled = enabled
        self.source = source
        self.best = self._load()
        self._pending: tuple[int, float] | None = None

    def _load(self) -> dict | None:
        path = self.root / "best.json"
        if not path.is_file():
            return None
        state = json.loads(path.read_text())
        if state.get("metric") != self.metric:
            log.warning("%s tracks %r, not checkpoint.keep_best=%r: starting a new record", path,
                        state.get("metric"), self.metric)
            return None
        if "source" in state and state["source"] != self.source:  # (older records lack it: continued)
            log.warning("%s scored %s on another eval set than this run's (%s): starting a new record", path,
                        self.metric, self.source)
            return None
        return state

    @property
    def step(self) -> int | None:
        return None if self.best is None else int(self.best["step"])

    def scored(self, weights_step: int, metrics: dict[str, float], latest_step: int) -> None:
        """An evaluation of the weights after `weights_step` updates (metrics hold self.key)."""
        value = metrics.get(self.key)
        if value is None or not math.isfinite(value):
            return
        self._pending = (weights_step, float(value))
        self.saved(latest_step)

    def saved(self, step: int) -> None:
        """Checkpoint `step` is complete: it becomes `best` when its weights' score beats the record."""
        if step < 1 or self._pending is None or self._pending[0] != step:
            return  # step 0: no checkpoint yet (a checkpoint's step counts updates, >= 1)
        value = self._pending[1]
        self._pending = None
        if self.best is not None and value <= self.best["value"]:
            return
        self.best = {"step": step, "metric": self.metric, "value": value}
        if self.source is not None:
            self.best["source"] = self.source
        if self.enabled:
            self.root.mkdir(parents=True, exist_ok=True)
            write_marker(self.root / "best.json", json.dumps(self.best))
            write_marker(self.root / "best", str(step))
            log.info("best checkpoint: step %d (%s = %.4g)", step, self.metric, value)
