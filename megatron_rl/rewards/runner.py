"""Run a reward function in a persistent worker process with a per-call timeout; failures score 0."""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

from megatron_rl.rewards.functions import RewardFn

logger = logging.getLogger(__name__)

MAX_LOGGED_FAILURES = 5  # per score() call; the stats always hold the full counts


def _worker_main(fn: RewardFn, conn: Connection, parent_end: Connection | None = None) -> None:
    """Score batches [(index, response, answer)] until None arrives or the parent is gone; one reply
    per item, in order. A forked worker inherits the parent's end of the pipe: closed here, or the
    worker would never read EOF after a SIGKILLed parent and outlive it (orphaned, out of reach of a
    scheduler that ends a job by its process tree)."""
    if parent_end is not None:
        parent_end.close()
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        for index, response, answer in batch:
            try:
                value = float(fn(response, answer))
                if not math.isfinite(value):
                    raise ValueError(f"non-finite reward {value}")
                conn.send((index, "ok", value))
            except Exception as err:  # any user error scores 0; SystemExit etc. kill the worker
                conn.send((index, "error", f"{type(err).__name__}: {err}"))


class RewardRunner:
    """Scores (response, answer) pairs with `fn` in a worker process.

    An exception (or a non-finite / non-numeric result, or the worker dying) gives reward 0.0 and
    counts in `num_errors`; a call running past `timeout_s` gives 0.0, counts in `num_timeouts`, and
    the worker is killed and restarted for the remaining items. The worker persists across calls
    and a batch is one message, so a fast function costs one round trip per item.

    `mp_context="fork"` (default) lets closures and lambdas run without pickling and starts a
    worker in milliseconds. Hazard: fork copies only the calling thread, so a reward function must
    not rely on locks or threads of the parent (torch intra-op pools are not used by the worker).
    Use "forkserver" or "spawn" for functions that need a clean interpreter (they must be picklable).

        with RewardRunner(get_reward_fn("exact_match"), timeout_s=5.0) as runner:
            rewards, stats = runner.score(responses, answers)
    """

    def __init__(self, fn: RewardFn, timeout_s: float = 10.0, mp_context: str = "fork", name: str | None = None):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if mp_context not in mp.get_all_start_methods():
            raise ValueError(f"mp_context {mp_context!r} not available; choose from {mp.get_all_start_methods()}")
        self.fn = fn
        self.timeout_s = timeout_s
        self.name = name or getattr(fn, "__name__", repr(fn))
        self._ctx = mp.get_context(mp_context)
        self._proc: Any = None
        self._conn: Connection | None = None
        self.num_restarts = 0  # workers replaced after a timeout or a death

    def _ensure_worker(self) -> Connection:
        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None:
                self._kill_worker()
                self.num_restarts += 1
            parent_conn, child_conn = self._ctx.Pipe()
            self._proc = self._ctx.Process(target=_worker_main, args=(self.fn, child_conn, parent_conn),
                                          daemon=True)
            self._proc.start()
            # Close the parent's copy of the child end: otherwise a dead worker never reads as EOF.
            child_conn.close()
            self._conn = parent_conn
        assert self._conn is not None
        return self._conn

    def _kill_worker(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def score(self, responses: list[str], answers: list[str]) -> tuple[list[float], dict[str, int]]:
        """Rewards (one float per response, in order) and stats {"num_errors", "num_timeouts"}."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        rewards = [0.0] * len(responses)
        stats = {"num_errors": 0, "num_timeouts": 0}
        pending = list(range(len(responses)))
        while pending:
            conn = self._ensure_worker()
            conn.send([(i, responses[i], answers[i]) for i in pending])
            pending = self._collect(conn, pending, rewards, stats)
        return rewards, stats

    def _collect(self, conn: Connection, pending: list[int], rewards: list[float], stats: dict[str, int]) -> list[int]:
        """Read replies for `pending` in order; after a timeout or a worker death return the rest."""
        for k, index in enumerate(pending):
            status, value = self._read(conn, index)
            if status == "ok":
                rewards[index] = value
                continue
            self._record(stats, "num_timeouts" if status == "timeout" else "num_errors", index, value)
            if status in ("timeout", "died"):
                self._kill_worker()
                self.num_restarts += 1  # the next send starts a fresh worker
                return pending[k + 1 :]
        return []

    def _read(self, conn: Connection, index: int) -> tuple[str, Any]:
        """("ok", reward) | ("error", reason) | ("timeout", reason) | ("died", reason)."""
        try:
            if not conn.poll(self.timeout_s):
                return "timeout", f"timed out after {self.timeout_s} s"
            got, status, value = conn.recv()
        except (EOFError, OSError):
            return "died", "reward worker process died"
        assert got == index, f"reward worker replied for item {got}, expected {index}"
        return status, value

    def _record(self, stats: dict[str, int], key: str, index: int, reason: str) -> None:
        stats[key] += 1
        failures = stats["num_errors"] + stats["num_timeouts"]
        if failures <= MAX_LOGGED_FAILURES:
            logger.warning("reward fn %s on item %d scored 0.0: %s", self.name, index, reason)

    def close(self) -> None:
        """Stop the worker (politely, then by kill after 1 s)."""
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            try:
                self._conn.send(None)
                self._proc.join(timeout=1.0)
            except (OSError, BrokenPipeError):
                pass
        self._kill_worker()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass
