"""Run a reward function in a pool of persistent worker processes with a per-call timeout; failures score 0."""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from megatron_rl.rewards.user import accepted_extras

logger = logging.getLogger(__name__)

MAX_LOGGED_FAILURES = 5  # per score() call; the stats always hold the full counts
STARTUP_TIMEOUT_S = 120.0  # a worker's start (fork, or spawn's imports) is not the reward function's time
CHUNKS_PER_WORKER = 4  # per-sample work goes out in ~4 chunks per worker: one slow chunk waits for little


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


def _worker_main(fn: Callable, conn: Connection, batched: bool, parent_end: Any = None) -> None:
    """Score batches [(index, response, answer, extra)] until None arrives or the parent is gone.
    Per-sample: one reply per item, in order; batched: one reply for the whole batch (a list of
    per-item results). A forked worker inherits the parent's ends of the pipes (its own and those
    of the pool's other workers): `parent_end` (one or a tuple) is closed here, or the worker would
    never read EOF after a SIGKILLed parent and outlive it (orphaned, out of reach of a scheduler
    that ends a job by its process tree)."""
    for end in parent_end if isinstance(parent_end, tuple) else (parent_end,):
        if end is not None:
            end.close()
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


class RewardWorker:
    """One worker process of the pool and the items it holds: `items` (indices, in the order the
    worker answers them) and `deadline` (time.monotonic() by which its next message is due).

    A worker starts without blocking the pool: its first work goes into the pipe at once, and until
    its "ready" message arrives the deadline is STARTUP_TIMEOUT_S, not timeout_s (timeout_s bounds
    the function, not the start of a worker on a loaded host: a fork can take seconds there, spawn
    imports the function's module). A pool replacing many timed-out workers restarts them in parallel."""

    def __init__(self, runner: "RewardRunner") -> None:
        self.runner = runner
        self.proc: Any = None
        self.conn: Connection | None = None
        self.ready = False
        self.items: deque[int] = deque()
        self.deadline = 0.0

    def start(self) -> Connection:
        """The live worker's pipe, starting (or replacing a dead) one first."""
        if self.proc is None or not self.proc.is_alive():
            if self.proc is not None:
                self.kill()
                self.runner.num_restarts += 1
            ctx = self.runner._ctx
            parent_conn, child_conn = ctx.Pipe()
            inherited = tuple(w.conn for w in self.runner.workers if w.conn is not None)
            self.proc = ctx.Process(target=_worker_main, daemon=True,
                                    args=(self.runner.fn, child_conn, self.runner.batched, (parent_conn, *inherited)))
            self.proc.start()
            # Close the parent's copy of the child end: otherwise a dead worker never reads as EOF.
            child_conn.close()
            self.conn, self.ready = parent_conn, False
        assert self.conn is not None
        return self.conn

    def submit(self, items: list[int], payload: list) -> None:
        self.start().send(payload)
        self.items = deque(items)
        self.deadline = time.monotonic() + (self.runner.timeout_s if self.ready else STARTUP_TIMEOUT_S)

    def read(self) -> tuple[str, Any]:
        """The next message: ("ready", None) | ("ok", result) | ("error", reason) | ("died", reason),
        the last three for items[0]; RuntimeError naming the reward when the worker died starting."""
        try:
            got, status, value = self.conn.recv()
        except (EOFError, OSError):
            if not self.ready:
                self.proc.join(timeout=5.0)
                self.failed_to_start(f"exited at start-up (exit code {self.proc.exitcode})")
            return "died", "reward worker process died"
        self.deadline = time.monotonic() + self.runner.timeout_s
        if status == "ready":
            self.ready = True
            return status, None
        assert got == self.items[0], f"reward worker replied for item {got}, expected {self.items[0]}"
        return status, value

    def failed_to_start(self, reason: str) -> None:
        self.kill()
        raise RuntimeError(f"reward worker for {self.runner.name} {reason}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn, self.ready, self.items = None, None, False, deque()

    def close(self) -> None:
        """Stop the worker (politely, then by kill after 1 s)."""
        if self.proc is not None and self.proc.is_alive() and self.conn is not None:
            try:
                self.conn.send(None)
                self.proc.join(timeout=1.0)
            except (OSError, BrokenPipeError):
                pass
        self.kill()


class RewardRunner:
    """Scores (response, answer, extra) triples with `fn` in a pool of `num_workers` processes.

    An exception (or a non-finite / non-numeric result, or the worker dying) gives reward 0.0 and
    counts in `num_errors`; a call running past `timeout_s` gives 0.0, counts in `num_timeouts`, and
    that worker is killed and restarted for its remaining items. Workers persist across calls and
    start when first given work. Per-sample work goes out in chunks (about CHUNKS_PER_WORKER per
    worker, one message each, one reply per item), handed to whichever worker is free, so slow or
    hanging samples delay only their own chunk: a step's wall time is about its total reward time
    / num_workers, not the sum.

    `batched=True`: `fn(responses, answers, **extra_lists) -> list` scores the whole batch in one
    call (a batched function may rely on seeing all of it: group-relative scoring, its own batching
    to a judge), bounded by `timeout_s`; a raise or a timeout scores every sample 0 (counted per
    sample). Only per-sample work is spread over the pool. Extra columns reach `fn`
    as keyword arguments: those it names, or all of them when it takes **kwargs.

    `mp_context="fork"` (default) lets closures and lambdas run without pickling and starts a
    worker in milliseconds. Hazard: fork copies only the calling thread, so a reward function must
    not rely on locks or threads of the parent (torch intra-op pools are not used by the worker).
    Use "forkserver" or "spawn" for functions that need a clean interpreter (they must be picklable).

        with RewardRunner(get_reward_fn("exact_match"), timeout_s=5.0, num_workers=4) as runner:
            rewards, stats = runner.score(responses, answers)
    """

    def __init__(self, fn: Callable, timeout_s: float = 10.0, mp_context: str = "fork", name: str | None = None,
                 batched: bool = False, num_workers: int = 1):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if mp_context not in mp.get_all_start_methods():
            raise ValueError(f"mp_context {mp_context!r} not available; choose from {mp.get_all_start_methods()}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.fn = fn
        self.timeout_s = timeout_s
        self.batched = batched
        self.name = name or getattr(fn, "__name__", repr(fn))
        self._extras = accepted_extras(fn)
        self._ctx = mp.get_context(mp_context)
        self.workers = [RewardWorker(self) for _ in range(num_workers)]
        self.num_restarts = 0  # workers replaced after a timeout or a death

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
        payload = [(i, responses[i], answers[i], extras[i]) for i in range(len(responses))]
        results: list[Any] = [None] * len(responses)
        stats: dict[str, Any] = {"num_errors": 0, "num_timeouts": 0}
        queue = deque(_chunks(len(responses), len(self.workers), self.batched))
        while queue or any(w.items for w in self.workers):
            for worker in self.workers:
                if not worker.items and queue:
                    items = queue.popleft()
                    worker.submit(items, [payload[i] for i in items])
            self._collect(queue, results, stats)
        return _assemble(results, stats)

    def _collect(self, queue: deque, results: list[Any], stats: dict[str, Any]) -> None:
        """Wait for the next reply (or the first deadline) of the busy workers and take what came."""
        busy = [w for w in self.workers if w.items]
        timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
        ready = wait([w.conn for w in busy], timeout=timeout)
        for worker in busy:
            if worker.conn in ready:
                self._take(worker, queue, results, stats)
            elif time.monotonic() >= worker.deadline and not worker.ready:
                worker.failed_to_start(f"did not start within {STARTUP_TIMEOUT_S:g} s")
            elif time.monotonic() >= worker.deadline:
                self._fail_head(worker, queue, stats, "num_timeouts", f"timed out after {self.timeout_s} s")

    def _take(self, worker: RewardWorker, queue: deque, results: list[Any], stats: dict[str, Any]) -> None:
        status, value = worker.read()
        if status == "ready":
            return
        if status == "died":
            self._fail_head(worker, queue, stats, "num_errors", value)
        elif self.batched:
            for index, (item_status, item) in zip(worker.items, value):
                if item_status == "ok":
                    results[index] = item
                else:
                    self._record(stats, "num_errors", index, item)
            worker.items.clear()
        else:
            index = worker.items.popleft()
            if status == "ok":
                results[index] = value
            else:
                self._record(stats, "num_errors", index, value)

    def _fail_head(self, worker: RewardWorker, queue: deque, stats: dict[str, Any], key: str, reason: str) -> None:
        """A timeout or a death: the item being scored fails (batched: the whole batch); the rest of
        the chunk goes back to the queue's front; the worker is killed (the next submit restarts it)."""
        failed = list(worker.items) if self.batched else [worker.items[0]]
        rest = [] if self.batched else list(worker.items)[1:]
        for index in failed:
            self._record(stats, key, index, reason)
        if rest:
            queue.appendleft(rest)
        worker.kill()
        self.num_restarts += 1

    def _record(self, stats: dict[str, Any], key: str, index: int, reason: str) -> None:
        stats[key] += 1
        failures = stats["num_errors"] + stats["num_timeouts"]
        if failures <= MAX_LOGGED_FAILURES:
            logger.warning("reward fn %s on item %d scored 0.0: %s", self.name, index, reason)

    def close(self) -> None:
        """Stop every worker (politely, then by kill after 1 s each)."""
        for worker in self.workers:
            worker.close()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass


def _chunks(count: int, num_workers: int, batched: bool) -> list[list[int]]:
    """Item indices in submission order: batched, the whole batch; per sample, about
    CHUNKS_PER_WORKER chunks per worker (one chunk with one worker, as a single process)."""
    parts = 1 if batched or num_workers == 1 else num_workers * CHUNKS_PER_WORKER
    size = max(1, math.ceil(count / parts))
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


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
