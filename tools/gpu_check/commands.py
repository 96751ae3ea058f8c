"""Checks that run a command: the TE bundle's smoke test, the CUDA tests of the suite, the tiny RL
loop on CUDA with the TE spec, and `megatron-rl doctor`.

te_smoke    the bundle's te_smoke.py (RMSNorm, te.Linear in BF16 and under current, block and delayed
            scaling against an fp32 reference): `TE_SMOKE PASS`
pytest_gpu  tests/gpu: the actor, the plan, packing on CUDA, the IPC payload (no SGLang needed);
            dry: collected only
te_parity   tests/gpu/test_te_parity.py, early in the call (numerics.py lists it): TE's quantizers
            against the emulation, bytes and scales bitwise; te.Linear against the emulated linear
sglang      tests/gpu/test_sglang_smoke.py where SGLang is installed (SKIP otherwise)
tiny_loop   examples/tiny/fp8_calibrated.yaml on CUDA with the TE spec, 4 GRPO steps with Calibrated
            Clipping, checkpoints; PASS with 4 metric rows
doctor      `megatron-rl doctor --json OUT/doctor.json` (SKIP where the command does not exist yet)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from common import Check, Skip, need_module

PYTEST_GPU = ["tests/gpu/test_actor_gpu.py", "tests/gpu/test_plan_memory.py", "tests/gpu/test_packing_cuda.py",
              "tests/gpu/test_sglang_ipc_payload.py"]
TE_PARITY = ["tests/gpu/test_te_parity.py"]
TINY = ["examples/tiny/fp8_calibrated.yaml", "parallel.transformer_impl=transformer_engine", "train.num_steps=4",
        "train.sft_steps=10", "eval.at_start=false", "eval.at_end=false", "eval.every=0",
        "checkpoint.save_every=2", "checkpoint.resume=false"]


def _run(argv, log_name: str, ctx, timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    with open(os.path.join(ctx.out_dir, log_name), "a") as f:
        f.write(f"$ {' '.join(argv)}\n{out.stdout}\n{out.stderr}\nrc={out.returncode}\n")
    return out


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def te_smoke(ctx):
    bundle = os.environ.get("GPU_CHECK_BUNDLE", ".gpu")
    script = os.path.join(bundle, "te_smoke.py")
    if not os.path.isfile(script):
        raise Skip(f"{script} is missing (no TE bundle carried)")
    ctx.need_cuda()
    need_module("transformer_engine")
    out = _run([sys.executable, script], "commands.log", ctx, 100)
    last = _last_line(out.stdout)
    return {"rc": out.returncode, "last": last, "ok": out.returncode == 0 and last.startswith("TE_SMOKE PASS")}


def _pytest(ctx, files: list[str], timeout: float) -> dict:
    need_module("pytest")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if ctx.dry:
        out = _run(argv + ["--collect-only"], "commands.log", ctx, 100)
        collected = [ln for ln in out.stdout.splitlines() if "::" in ln]
        if out.returncode not in (0, 5):
            return {"rc": out.returncode, "last": _last_line(out.stdout), "ok": False}
        raise Skip(f"dry-run: {len(collected)} tests collected; they need CUDA")
    out = _run(argv + ["-rfEs"], "commands.log", ctx, timeout)
    failed = [ln for ln in out.stdout.splitlines() if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    # A skip for want of CUDA or TE on the GPU machine is a failure; a Blackwell-only case (MXFP8) is not.
    bad_skips = [ln for ln in failed if ln.startswith("SKIPPED") and "not supported on this GPU" not in ln]
    return {"rc": out.returncode, "last": _last_line(out.stdout), "not_passed": failed[:12],
            "ok": out.returncode == 0 and not bad_skips}


def pytest_gpu(ctx):
    return _pytest(ctx, PYTEST_GPU, 170)


def te_parity(ctx):
    return _pytest(ctx, TE_PARITY, 80)


def sglang(ctx):
    ctx.need_cuda()
    need_module("sglang")
    out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu/test_sglang_smoke.py"],
               "commands.log", ctx, 170)
    return {"rc": out.returncode, "last": _last_line(out.stdout), "ok": out.returncode == 0}


def tiny_loop(ctx):
    from megatron_rl.config import load_config
    log_dir = os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "tiny_loop")  # a fresh run folder
    argv = [*TINY, f"log.dir={log_dir}"]
    load_config(argv[0], argv[1:])  # the overrides are checked on CPU too
    ctx.need_cuda()
    metrics = os.path.join(log_dir, "metrics.jsonl")
    out = _run([sys.executable, "-m", "megatron_rl.cli", "train", *argv], "tiny_loop.log", ctx, 170)
    rows = [json.loads(ln) for ln in open(metrics)] if os.path.exists(metrics) else []
    steps = [r for r in rows if "step" in r]
    last = steps[-1] if steps else {}
    return {"rc": out.returncode, "metric_rows": len(steps),
            "last": {k: last[k] for k in ("step", "loss", "reward/mean", "time/step") if k in last},
            "ok": out.returncode == 0 and len(steps) >= 4}


def doctor(ctx):
    path = os.path.join(ctx.out_dir, "doctor.json")
    argv = [sys.executable, "-m", "megatron_rl.cli", "doctor", "--json", path]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    if out.returncode == 2 and "invalid choice" in out.stderr:
        raise Skip("`megatron-rl doctor` does not exist in this checkout yet")
    detail = {"rc": out.returncode, "last": _last_line(out.stdout + out.stderr)[-300:]}
    if os.path.isfile(path):
        detail["json_keys"] = sorted(json.load(open(path)))[:20]
    detail["ok"] = out.returncode == 0 and os.path.isfile(path)
    return detail


CHECKS = [Check("te_smoke", te_smoke, 100), Check("te_parity", te_parity, 90), Check("pytest_gpu", pytest_gpu, 180),
          Check("sglang", sglang, 180),
          Check("tiny_loop", tiny_loop, 180), Check("doctor", doctor, 100)]
