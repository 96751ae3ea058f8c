"""The check machinery of tools/gpu_check: a check's context, its result line and record, its alarm.

A check is `fn(ctx) -> dict` (its detail; "ok": False makes it FAIL). It does its CPU-side part
first (configs, model specs, payloads, plans), then calls `ctx.need_cuda()`, which in the dry mode
raises Skip: so `--dry-run` exercises every check's code up to the first CUDA use.
Ratios a check measures go in its detail under "ratios" ({name: float}); main.py collects them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
import traceback
from dataclasses import dataclass, field


class Skip(Exception):
    """The check cannot run here (no CUDA in the dry mode, a package missing)."""


class CheckTimeout(Exception):
    """The check's own alarm fired (its budget in seconds)."""


@dataclass(frozen=True)
class Check:
    name: str
    fn: object
    budget_s: float
    """The check's alarm: it FAILs when it runs longer (a wedged CUDA call is killed by main.py)."""


@dataclass
class Context:
    dry: bool
    out_dir: str
    results_path: str
    stall: dict = field(default_factory=dict)
    """check name -> seconds slept before it runs (tests of the timeout machinery only)."""
    check_timeout: float = 0.0
    """> 0: caps every check's alarm (seconds)."""

    def need_cuda(self) -> None:
        if self.dry:
            raise Skip("dry-run: CPU-side part ran; the rest needs CUDA")
        import torch
        if not torch.cuda.is_available():
            raise Skip("no CUDA here")

    def device(self) -> str:
        return "cpu" if self.dry else "cuda"


def need_module(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{module} is not installed")


def format_line(status: str, name: str, detail: dict) -> str:
    shown = {k: v for k, v in detail.items() if k != "trace"}
    return f"{status} {name} {json.dumps(shown, sort_keys=True, default=str)}"


def _alarm(seconds: float):
    def fire(signum, frame):
        raise CheckTimeout(f"timed out after {seconds:.0f} s (the check's budget)")
    signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))


def run_check(ctx: Context, check: Check, group: str) -> dict:
    """Run one check under its alarm; print its line, append its record to ctx.results_path."""
    start = time.perf_counter()
    _alarm(min(check.budget_s, ctx.check_timeout) if ctx.check_timeout > 0 else check.budget_s)
    try:
        if check.name in ctx.stall:
            time.sleep(ctx.stall[check.name])
        detail = dict(check.fn(ctx) or {})
        status = "PASS" if detail.pop("ok", True) else "FAIL"
    except Skip as why:
        status, detail = "SKIP", {"reason": str(why)}
    except BaseException as err:  # every check gets its line; KeyboardInterrupt included
        status = "FAIL"
        detail = {"error": f"{type(err).__name__}: {err}"[:600], "trace": traceback.format_exc()[-2000:]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    detail["seconds"] = round(time.perf_counter() - start, 2)
    record = {"name": check.name, "group": group, "status": status, "detail": detail}
    print(format_line(status, check.name, detail), flush=True)
    with open(ctx.results_path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    _free_cuda()
    return record


def _free_cuda() -> None:
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timed(fn, repeats: int, warmup: int = 1, cuda: bool = True) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup` calls (CUDA synchronized)."""
    import statistics

    import torch
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
