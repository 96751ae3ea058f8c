#!/usr/bin/env bash
# The entropy surge of full-pipeline low precision, on a laptop CPU (about 10 minutes on 2 cores):
# BF16 vs vanilla NVFP4 vs NVFP4 + TIS vs NVFP4 + Calibrated Clipping, one seed, 60 GRPO steps of
# the `chain` task. Writes runs/surge_example/report/ (report.md, health.png, learning.png, ...).
# Extra arguments go to examples/reproduce/run.py (e.g. --seeds 1 2 3, or section.key=value).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
exec "$PY" examples/reproduce/run.py --study surge --stage arms --setting chain_nvfp4 \
  --variants chain_bf16 chain_nvfp4 chain_nvfp4_tis chain_nvfp4_calibrated \
  --jobs "${JOBS:-2}" --runs-dir runs/surge_example --out runs/surge_example/report "$@"
