#!/usr/bin/env bash
# Builds, once per machine, the virtual environment in which the real SGLang server runs on CPU for
# the tests in tests/sglang_real (PyPI's sglang with its own pins: torch 2.14.1 CUDA build, which
# runs on CPU; about 4.4 GB of downloads, 11 GB on disk, 4-8 minutes).
#
#   tools/sglang_cpu_venv.sh          # build if absent; print the venv's path
#   tools/sglang_cpu_venv.sh --path   # only print where it is (or would be)
#
# Where: $MEGATRON_RL_SGLANG_VENV if set, else ~/.cache/megatron_rl/sglang-cpu-<versions>.
# Idempotent: a venv is complete only once its marker file exists; a half-built one is rebuilt.
# The interpreter: $SGLANG_VENV_PYTHON, else python3 (>= 3.10).
set -euo pipefail

SGLANG_VERSION=0.5.23
ROUTER_VERSION=0.3.2
# The pins below are the ones the tests were checked against; the cache key changes with them.
PACKAGES=("sglang==${SGLANG_VERSION}" "sglang-router==${ROUTER_VERSION}")
KEY="sglang${SGLANG_VERSION}-router${ROUTER_VERSION}"
VENV=${MEGATRON_RL_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron_rl/sglang-cpu-${KEY}}
MARKER="$VENV/.megatron_rl_complete"

if [[ "${1:-}" == "--path" ]]; then
  echo "$VENV"
  exit 0
fi
if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$KEY" ]]; then
  echo "$VENV"
  exit 0
fi

PYTHON=${SGLANG_VENV_PYTHON:-python3}
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
# This machine's pip constraints (if any) stay in force; sglang pins its own torch.
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
for package in "${PACKAGES[@]}"; do  # one at a time: a resolver conflict names its package
  "$VENV/bin/python" -m pip install -q "$package" >&2
done
"$VENV/bin/python" -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__)" >&2
echo "$KEY" >"$MARKER"
echo "built in $(( $(date +%s) - start )) s" >&2
echo "$VENV"
