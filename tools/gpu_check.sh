#!/usr/bin/env bash
# The GPU check of the real stack in one call (one H100/H200, under 8 minutes): Transformer Engine and
# Megatron-Core's FP8 path, the emulation against Hopper's FP8 GEMMs, the colocated protocol's pieces
# (tcp:// start from a torchrun worker, CUDA IPC sync, offload, CUDA graphs), the memory plan, the
# tiny RL loop on CUDA, `megatron-rl doctor`, and the numbers only a GPU gives (FP8 / BF16 train and
# rollout throughput, weight sync s/GB, Calibrated Clipping's cost, plan / measured peak).
#
#   bash tools/gpu_check.sh [--dry-run] [--out DIR] [--bundle DIR] [--budget SECONDS] [--only A,B]
#
# Run from the repository root. --bundle (default .gpu) holds the carried Transformer Engine bundle
# (te-*.tar.xz, the megatron-core and torchao wheels, te_smoke.py); it is unpacked with Python's
# tarfile / zipfile into the temp folder and put first on PYTHONPATH; nothing is installed or
# downloaded. The exact device call is in docs/gpu_check/README.md, the checks in tools/gpu_check/*.py.
#
# Prints `PASS|FAIL|SKIP <check> <json detail>` per check, then writes OUT/gpu_check.json (summary:
# checks, ratios, device), OUT/performance.md (README's performance rows) and logs (gpu_check.txt,
# groups.log, commands.log, tiny_loop.log, doctor.json). Exit 1 when a check fails. Each check has its
# own timeout and the whole call stops itself inside --budget (default 470 s) with the summary written.
# --dry-run runs on CPU whatever needs no CUDA (arguments, the bundle's layout, each check's CPU part).
set -uo pipefail
PYTHON="${PYTHON:-python3}"
exec "$PYTHON" "$(dirname "$0")/gpu_check/main.py" "$@"
