"""tools/gpu_check.sh's runner: every check group in its own process under the call's time budget.

    python tools/gpu_check/main.py [--dry-run] [--out DIR] [--bundle DIR] [--budget S] [--only A,B]

One line per check, `PASS|FAIL|SKIP <check> <json detail>`, as each ends; then OUT/gpu_check.json
(the summary: every check's status and detail, the ratios, the device) and OUT/performance.md (the
ratios as a markdown table for README's performance section). Exit 1 when a check FAILs.

Budget: each check has its own alarm (common.Check.budget_s); each group's process is killed when
the call's budget runs out (less a reserve for the groups after it), its unfinished checks FAIL
with "killed", and the summary is written all the same. --dry-run runs on CPU: the bundle's
layout, every module's imports and each check's CPU-side part; the checks that need CUDA SKIP.
The dry mode runs its groups at once (--jobs); with CUDA they run one after the other.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GROUPS = ("smoke", "numerics", "te_path", "colocated", "plan_peak", "perf", "commands")
"""In run order: the most informative first, so that a budget overrun cuts the least."""
MODULE_OF = {"smoke": "commands", "commands": "commands"}
SMOKE = ("te_smoke", "te_parity")
"""The first group: TE's own smoke test, then TE's quantizers against the emulation, bitwise."""
GROUP_TIME = {"smoke": (120, 30), "numerics": (45, 15), "te_path": (120, 40), "colocated": (90, 30),
              "plan_peak": (70, 25), "perf": (120, 45), "commands": (180, 40)}
"""group -> (cap, floor) in seconds: a group is killed after its cap, and keeps the floors of the
groups after it free (expected times on an H100 / H200 are about half the caps)."""
RESERVE_S = 8.0
"""A group with less than this left is not started (its checks SKIP)."""
SCHEMA = 1
RATIOS = {
    "train_fp8_over_bf16_tokens_per_s": "FP8 (blockwise) / BF16 train-step tokens/s, Qwen3-1.7B shape, TE spec",
    "train_mfu_bf16": "MFU, BF16 train step (dense BF16 peak)",
    "train_mfu_fp8": "MFU, FP8 train step (against the dense BF16 peak)",
    "calib_shadow_extra_per_step": "Calibrated Clipping: shadow passes / (old log-probs + train step)",
    "rollout_fp8_over_bf16_tokens_per_s": "embedded engine tokens/s, fp8_blockwise / bf16",
    "weight_sync_inprocess_s_per_gb": "weight sync in-process (FP8 payload), s/GB",
    "weight_sync_ipc_s_per_gb": "weight sync over CUDA IPC to a second process, s/GB",
    "plan_peak_over_measured_te_fp8": "planned / measured peak memory, TE spec, FP8",
    "plan_peak_over_measured_te_bf16": "planned / measured peak memory, TE spec, BF16",
}


def group_checks(group: str) -> list:
    module = importlib.import_module(MODULE_OF.get(group, group))
    checks = module.CHECKS
    if group == "smoke":
        return [c for c in checks if c.name in SMOKE]
    if group == "commands":
        return [c for c in checks if c.name not in SMOKE]
    return checks


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU only: everything that does not need CUDA")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="folder of the summary")
    ap.add_argument("--bundle", default=".gpu", help="the carried TE bundle folder (tarball, wheels, te_smoke.py)")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds for the whole call (default 470: under 8 minutes)")
    ap.add_argument("--only", default="", help="comma-separated groups or checks to run (default all)")
    ap.add_argument("--check-timeout", type=float, default=0.0,
                    help="seconds: caps every check's own timeout (default: each check's budget)")
    ap.add_argument("--stall", action="append", default=[], metavar="CHECK=SECONDS",
                    help="sleep before CHECK (tests of the budget machinery)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="groups at once (default: 1 with CUDA, whose groups share the GPU; all in the dry mode)")
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.budget <= 0:
        ap.error(f"--budget must be > 0 seconds, got {args.budget}")
    known = {"bundle", *GROUPS} | {c.name for g in GROUPS for c in group_checks(g)}
    unknown = sorted(set(filter(None, args.only.split(","))) - known)
    if unknown:
        ap.error(f"--only names unknown groups or checks {unknown}; known: {sorted(known)}")
    stall = {}
    for item in args.stall:
        name, _, seconds = item.partition("=")
        if name not in known or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--stall {item!r}: expected CHECK=SECONDS with a known check")
        stall[name] = float(seconds)
    args.stall = stall
    if args.jobs < 0:
        ap.error(f"--jobs must be >= 1 (0: the default), got {args.jobs}")
    if args.jobs == 0:
        args.jobs = len(GROUPS) if args.dry_run else 1
    if args.jobs > 1 and not args.dry_run:
        ap.error("--jobs > 1 is for the dry mode only: the groups' measurements share one GPU")
    return args


# ---- one group, in its own process -----------------------------------------------------------

def run_group(args) -> int:
    from common import Context, run_check
    ctx = Context(dry=args.dry_run, out_dir=args.out, results_path=args.results, stall=args.stall,
                  check_timeout=args.check_timeout)
    if not args.dry_run:
        _record_device(args.results)
    only = set(filter(None, args.only.split(",")))
    for check in group_checks(args.group):
        if not only or args.group in only or check.name in only:
            run_check(ctx, check, args.group)
    return 0


def _record_device(path: str) -> None:
    import torch
    if not torch.cuda.is_available():
        return
    props = torch.cuda.get_device_properties(0)
    device = {"name": props.name, "capability": list(torch.cuda.get_device_capability()),
              "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
              "cuda": torch.version.cuda}
    with open(path, "a") as f:
        f.write(json.dumps({"device": device}) + "\n")


# ---- the whole call --------------------------------------------------------------------------

class Runner:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.records: dict[str, dict] = {}
        self.device: dict | None = None
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, HERE, os.environ.get("PYTHONPATH", "")) if p)
        for key, value in (("NVTE_FLASH_ATTN", "1"), ("NVTE_FUSED_ATTN", "1"), ("OMP_NUM_THREADS", "8"),
                           # the contract's FP32 block scales: TE reads this once, at import (docs/fp8.md)
                           ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")):
            self.env.setdefault(key, value)
        self.txt = open(os.path.join(args.out, "gpu_check.txt"), "w")

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def emit(self, record: dict) -> None:
        from common import format_line
        self.records[record["name"]] = record
        self.txt.write(format_line(record["status"], record["name"], record["detail"]) + "\n")
        self.txt.flush()

    def add(self, name: str, group: str, status: str, detail: dict) -> None:
        from common import format_line
        print(format_line(status, name, detail), flush=True)
        self.emit({"name": name, "group": group, "status": status, "detail": detail})

    def bundle(self) -> None:
        import bundle
        start = time.monotonic()
        if not os.path.isdir(self.args.bundle):
            self.add("bundle", "bundle", "SKIP", {"reason": f"no bundle folder {self.args.bundle}"})
            return
        self.env["GPU_CHECK_BUNDLE"] = os.path.abspath(self.args.bundle)  # where te_smoke finds its script
        try:
            if self.args.dry_run and bundle.python_tag() in bundle.layout(self.args.bundle)["python_tags"]:
                detail = self._unpack_and_import()  # a CPU machine with the bundle's Python: TE imports there
            elif self.args.dry_run:
                detail = bundle.layout(self.args.bundle)
                detail["import"] = ("skipped: the bundle is for " + ",".join(detail["python_tags"]) +
                                    f", this Python is {bundle.python_tag()}")
            else:
                dest = os.path.join(tempfile.gettempdir(), "te_bundle")
                detail = bundle.unpack(self.args.bundle, dest)
                self.env = bundle.environment(dest, self.env)
            ok = not detail["missing"] and not detail["stray_test_package"]
            status = "PASS" if ok else "FAIL"
        except Exception as err:  # a broken bundle is one FAIL line; the checks then SKIP TE
            status, detail = "FAIL", {"error": f"{type(err).__name__}: {err}"}
        detail["seconds"] = round(time.monotonic() - start, 2)
        self.add("bundle", "bundle", status, detail)

    def _unpack_and_import(self) -> dict:
        import bundle
        dest = tempfile.mkdtemp(prefix="te_bundle_")
        detail = bundle.unpack(self.args.bundle, dest)
        probe = "import transformer_engine.pytorch, megatron.core, torchao; print(transformer_engine.__version__)"
        out = subprocess.run([sys.executable, "-c", probe], env=bundle.environment(dest, self.env),
                             capture_output=True, text=True, timeout=120)
        detail["import"] = f"ok: TE {out.stdout.strip()}" if out.returncode == 0 else f"failed: {out.stderr[-400:]}"
        if out.returncode:
            detail["missing"] = detail["missing"] or ["(import failed)"]
        return detail

    def selected(self, group: str) -> list[str]:
        only = set(filter(None, self.args.only.split(",")))
        return [c.name for c in group_checks(group) if not only or group in only or c.name in only]

    def run_groups(self, groups: list[str]) -> None:
        """--jobs groups at a time (1 with CUDA: the GPU is shared). Only this process prints the
        check lines, as the groups' result files grow, so lines never interleave."""
        pending, running = list(groups), []
        while pending or running:
            while pending and len(running) < self.args.jobs:
                group = pending.pop(0)
                started = self.start_group(group, later=pending if self.args.jobs == 1 else [])
                running += [started] if started else []
            time.sleep(0.2)
            for r in list(running):
                self._drain(r)
                over = time.monotonic() > r["deadline"]
                if r["proc"].poll() is None and not over:
                    continue
                if r["proc"].poll() is None:
                    os.killpg(r["proc"].pid, signal.SIGKILL)  # the group and everything it started
                r["proc"].wait()
                self._drain(r)
                self._finish(r, killed=over)
                running.remove(r)

    def start_group(self, group: str, later: list[str]) -> dict | None:
        """Start one group's process; `later`: the selected groups to start after it (their floors
        stay free). None when no time is left for it (its checks SKIP)."""
        names = self.selected(group)
        budgets = [min(c.budget_s, self.args.check_timeout or c.budget_s) for c in group_checks(group) if c.name in names]
        cap = GROUP_TIME[group][0]
        limit = min(cap, sum(budgets) + 30, self.left() - sum(GROUP_TIME[g][1] for g in later))
        if limit < RESERVE_S:
            for name in names:
                self.add(name, group, "SKIP", {"reason": f"budget: {self.left():.0f} s left of {self.args.budget:.0f}"})
            return None
        results = tempfile.NamedTemporaryFile(prefix=f"gpu_check_{group}_", suffix=".jsonl", delete=False).name
        argv = [sys.executable, os.path.join(HERE, "main.py"), "--group", group, "--results", results,
                "--out", self.args.out, "--only", self.args.only, f"--check-timeout={self.args.check_timeout}"]
        argv += ["--dry-run"] if self.args.dry_run else []
        argv += [f"--stall={k}={v}" for k, v in self.args.stall.items()]
        with open(os.path.join(self.args.out, "groups.log"), "a") as log:
            # Its own session: at the limit, the group and everything it started are killed together.
            proc = subprocess.Popen(argv, env=self.env, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
        return {"group": group, "names": names, "proc": proc, "results": results, "limit": limit,
                "deadline": time.monotonic() + limit, "offset": 0}

    def _drain(self, r: dict) -> None:
        """Print and keep the complete records the group has written since the last look."""
        from common import format_line
        with open(r["results"]) as f:
            f.seek(r["offset"])
            text = f.read()
        complete = text[:text.rfind("\n") + 1]
        r["offset"] += len(complete.encode())
        for line in complete.splitlines():
            record = json.loads(line)
            if "device" in record:
                self.device = self.device or record["device"]
                print(f"device {json.dumps(record['device'])}", flush=True)
                continue
            print(format_line(record["status"], record["name"], record["detail"]), flush=True)
            self.emit(record)

    def _finish(self, r: dict, killed: bool) -> None:
        os.unlink(r["results"])
        why = (f"killed at the group's limit of {r['limit']:.0f} s (budget)" if killed
               else f"the group's process ended with rc={r['proc'].returncode} (see groups.log)")
        for name in r["names"]:
            if name not in self.records:
                self.add(name, r["group"], "FAIL", {"error": why})

    def summary(self) -> int:
        counts = {s: sum(r["status"] == s for r in self.records.values()) for s in ("PASS", "FAIL", "SKIP")}
        ratios = {name: None for name in RATIOS}
        for record in self.records.values():
            for name, value in record["detail"].get("ratios", {}).items():
                ratios[name] = value
        out = {"schema": SCHEMA, "dry_run": self.args.dry_run, "device": self.device, "budget_s": self.args.budget,
               "elapsed_s": round(time.monotonic() - self.start, 1), "counts": counts, "ratios": ratios,
               "checks": {n: {k: r[k] for k in ("group", "status", "detail")} for n, r in self.records.items()}}
        with open(os.path.join(self.args.out, "gpu_check.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
        with open(os.path.join(self.args.out, "performance.md"), "w") as f:
            f.write(performance_table(ratios, self.device))
        print(f"SUMMARY {json.dumps(counts)} in {out['elapsed_s']} s -> {self.args.out}/gpu_check.json", flush=True)
        return 1 if counts["FAIL"] else 0


def performance_table(ratios: dict, device: dict | None) -> str:
    """README's performance rows: measured numbers only (a ratio not measured is left out)."""
    name = device["name"] if device else "no GPU"
    rows = [f"| {RATIOS[k]} | {v:.3g} | {name} |" for k, v in ratios.items() if v is not None]
    head = "| measured (one `tools/gpu_check.sh` call) | value | device |\n|---|---|---|\n"
    return head + "\n".join(rows) + ("\n" if rows else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.group:
        return run_group(args)
    os.makedirs(args.out, exist_ok=True)
    for stale in ("groups.log", "commands.log", "tiny_loop.log"):
        if os.path.exists(os.path.join(args.out, stale)):
            os.remove(os.path.join(args.out, stale))
    runner = Runner(args)
    only = set(filter(None, args.only.split(",")))
    if not only or "bundle" in only or "smoke" in only or "te_smoke" in only:
        runner.bundle()
    runner.run_groups([g for g in GROUPS if runner.selected(g)])
    return runner.summary()


if __name__ == "__main__":
    sys.exit(main())
