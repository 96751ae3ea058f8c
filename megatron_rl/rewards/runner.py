"""Run a reward function in a persistent worker process with a per-call timeout; failures score 0."""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any, Callable

from megatron_rl.rewards.user import accepted_extras

logger = logging.getLogger(__name__)

MAX_LOGGED_FAILURES = 5  # per score() call; the stats always hold the full counts
STARTUP_TIMEOUT_S = 120.0  # a worker's start (fork, or spawn's imports) is not the reward function's time


def normalize(value: Any) -> tuple[float, dict[str, float], str | None]:
    """A reward function's result as (score, numeric components, pred); ValueError if unusable.

    A number is the score. A dict holds "score" (required), an optional string "pred" (the
    extracted answer, verl's convention, which evaluation uses) and numeric components, each
    logged as reward/<name>; other values are ignored.
    """
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward dict without 'score': keys {sorted(value)}")
        components = {k: _finite(v) for k, v in value.items() if k not in ("score", "pred") and _is_number(v)}
        pred = value.get("pred")
        return _finite(value["score"]), components, None if pred is None else str(pred)
    return _finite(value), {}, None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, str)


def _finite(v: Any) -> float:
    value = float(v)
    if not math.isfinite(value):
        raise ValueError(f"non-finite reward {value}")
    return value


def _worker_main(fn: Callable, conn: Connection, batched: bool, parent_end: Connection | None = None) -> None:
    """Score batches [(index, response, answer, extra)] until None arrives or the parent is gone.
    Per-sample: one reply per item, in order; batched: one reply for the whole batch (a list of
    per-item results). A forked worker inherits the parent's end of the pipe: closed here, or the
    worker would never read EOF after a SIGKILLed parent and outlive it (orphaned, out of reach of a
    scheduler that ends a job by its process tree)."""
    if parent_end is not None:
        parent_end.close()
    try:
        conn.send((-1, "ready", None))  # the parent times the function from here, not the worker's start
    except OSError:  # the parent is gone already
        return
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        if batched:
            conn.send((batch[0][0] if batch else -1, "ok", _call_batched(fn, batch)))
            continue
        for index, response, answer, extra in batch:
            try:
                conn.send((index, "ok", normalize(fn(response, answer, **extra))))
            except Exception as err:  # any user error scores 0; SystemExit etc. kill the worker
                conn.send((index, "error", f"{type(err).__name__}: {err}"))


def _call_batched(fn: Callable, batch: list) -> list[tuple[str, Any]]:
    """[("ok", normalized) | ("error", reason)] per item; a raise fails every item of the batch."""
    keys = sorted({k for *_, extra in batch for k in extra})
    try:
        values = fn([b[1] for b in batch], [b[2] for b in batch],
                    **{k: [extra.get(k) for *_, extra in batch] for k in keys})
        if not isinstance(values, (list, tuple)) or len(values) != len(batch):
            raise ValueError(f"batched reward returned {type(values).__name__} of length "
                             f"{len(values) if hasattr(values, '__len__') else '?'} for {len(batch)} samples")
    except Exception as err:
        return [("error", f"{type(err).__name__}: {err}")] * len(batch)
    out = []
    for value in values:
        try:
            out.append(("ok", normalize(value)))
        except Exception as err:
            out.append(("error", f"{type(err).__name__}: {err}"))
    return out


class RewardRunner:
    """Scores (response, answer, extra) triples with `fn` in a worker process.

    An exception (or a non-finite / non-numeric result, or the worker dying) gives reward 0.0 and
    counts in `num_errors`; a call running past `timeout_s` gives 0.0, counts in `num_timeouts`, and
    the worker is killed and restarted for the remaining items. The worker persists across calls
    and a batch is one message, so a fast function costs one round trip per item.

    `batched=True`: `fn(responses, answers, **extra_lists) -> list` scores the whole batch in one
    call, bounded by `timeout_s`; a raise or a timeout scores every sample of it 0 (counted per sample).
    Extra columns reach `fn` as keyword arguments: those it names, or all of them when it takes **kwargs.

    `mp_context="fork"` (default) lets closures and lambdas run without pickling and starts a
    worker in milliseconds. Hazard: fork copies only the calling thread, so a reward function must
    not rely on locks or threads of the parent (torch intra-op pools are not used by the worker).
    Use "forkserver" or "spawn" for functions that need a clean interpreter (they must be picklable).

        with RewardRunner(get_reward_fn("exact_match"), timeout_s=5.0) as runner:
            rewards, stats = runner.score(responses, answers)
    """

    def __init__(self, fn: Callable, timeout_s: float = 10.0, mp_context: str = "fork", name: str | None = None,
                 batched: bool = False):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if mp_context not in mp.get_all_start_methods():
            raise ValueError(f"mp_context {mp_context!r} not available; choose from {mp.get_all_start_methods()}")
        self.fn = fn
        self.timeout_s = timeout_s
        self.batched = batched
        self.name = name or getattr(fn, "__name__", repr(fn))
        self._extras = accepted_extras(fn)
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
            self._proc = self._ctx.Process(target=_worker_main, args=(self.fn, child_conn, self.batched, parent_conn),
                                          daemon=True)
            self._proc.start()
            # Close the parent's copy of the child end: otherwise a dead worker never reads as EOF.
            child_conn.close()
            self._conn = parent_conn
            self._wait_ready(parent_conn)
        assert self._conn is not None
        return self._conn

    def _wait_ready(self, conn: Connection) -> None:
        """Wait for the worker's first message: timeout_s bounds the function, not the start of a
        worker on a loaded host (a fork can take seconds there; spawn imports the function's module)."""
        try:
            if conn.poll(STARTUP_TIMEOUT_S) and conn.recv()[1] == "ready":
                return
            reason = f"did not start within {STARTUP_TIMEOUT_S:g} s"
        except (EOFError, OSError):
            self._proc.join(timeout=5.0)
            reason = f"exited at start-up (exit code {self._proc.exitcode})"
        self._kill_worker()
        raise RuntimeError(f"reward worker for {self.name} {reason}")

    def _kill_worker(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def _extra_for_fn(self, extra: dict[str, Any]) -> dict[str, Any]:
        return dict(extra) if self._extras is None else {k: v for k, v in extra.items() if k in self._extras}

    def score(self, responses: list[str], answers: list[str],
              extras: list[dict[str, Any]] | None = None) -> tuple[list[float], dict[str, Any]]:
        """Rewards (one float per response, in order) and stats.

        stats: {"num_errors", "num_timeouts"} (ints); when the function returned dicts, also
        "components" {name: [float] per response, 0.0 where absent or failed} and "preds"
        [str | None]. `extras`: one dict of extra dataset columns per response (default none).
        """
        if len(responses) != len(answers) or (extras is not None and len(extras) != len(responses)):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers"
                             + ("" if extras is None else f" and {len(extras)} extras"))
        extras = [self._extra_for_fn(e) for e in extras] if extras is not None else [{}] * len(responses)
        results: list[Any] = [None] * len(responses)
        stats: dict[str, Any] = {"num_errors": 0, "num_timeouts": 0}
        pending = list(range(len(responses)))
        while pending:
            conn = self._ensure_worker()
            conn.send([(i, responses[i], answers[i], extras[i]) for i in pending])
            collect = self._collect_batched if self.batched else self._collect
            pending = collect(conn, pending, results, stats)
        return _assemble(results, stats)

    def _collect(self, conn: Connection, pending: list[int], results: list[Any], stats: dict[str, Any]) -> list[int]:
        """Read replies for `pending` in order; after a timeout or a worker death return the rest."""
        for k, index in enumerate(pending):
            status, value = self._read(conn, index)
            if status == "ok":
                results[index] = value
                continue
            self._record(stats, "num_timeouts" if status == "timeout" else "num_errors", index, value)
            if status in ("timeout", "died"):
                self._kill_worker()
                self.num_restarts += 1  # the next send starts a fresh worker
                return pending[k + 1 :]
        return []

    def _collect_batched(self, conn: Connection, pending: list[int], results: list[Any],
                         stats: dict[str, Any]) -> list[int]:
        """One reply for the batch; a timeout or a death fails all of it (nothing is retried)."""
        status, value = self._read(conn, pending[0])
        if status in ("timeout", "died"):
            for index in pending:
                self._record(stats, "num_timeouts" if status == "timeout" else "num_errors", index, value)
            self._kill_worker()
            self.num_restarts += 1
            return []
        for index, (item_status, item) in zip(pending, value):
            if item_status == "ok":
                results[index] = item
            else:
                self._record(stats, "num_errors", index, item)
        return []

    def _read(self, conn: Connection, index: int) -> tuple[str, Any]:
        """("ok", result) | ("error", reason) | ("timeout", reason) | ("died", reason)."""
        try:
            if not conn.poll(self.timeout_s):
                return "timeout", f"timed out after {self.timeout_s} s"
            got, status, value = conn.recv()
        except (EOFError, OSError):
            return "died", "reward worker process died"
        assert got == index, f"reward worker replied for item {got}, expected {index}"
        return status, value

    def _record(self, stats: dict[str, Any], key: str, index: int, reason: str) -> None:
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


def _assemble(results: list[Any], stats: dict[str, Any]) -> tuple[list[float], dict[str, Any]]:
    """Scores, and components / preds when any result carried them (failed items: 0.0 / None)."""
    done = [r for r in results if r is not None]
    rewards = [0.0 if r is None else r[0] for r in results]
    names = sorted({name for r in done for name in r[1]})
    if names:
        stats["components"] = {n: [0.0 if r is None else r[1].get(n, 0.0) for r in results] for n in names}
    if any(r[2] is not None for r in done):
        stats["preds"] = [None if r is None else r[2] for r in results]
    return rewards, stats
