"""The real SGLang 0.5.23 server on CPU, for the tests in this folder (test infrastructure).

The server runs in its own virtual environment (tools/sglang_cpu_venv.sh builds it once per machine;
it pins torch 2.14.1 and cannot share the project's). On CPU it needs (measured on a 2-core AVX-512 host):
- SGLANG_USE_CPU_ENGINE=1, no visible GPU, Hugging Face offline;
- `--device cpu --attention-backend torch_native --disable-overlap-schedule --max-total-tokens 4096`
  and a small --mem-fraction-static;
- server_path/ first on its PYTHONPATH: a stand-in for sgl_kernel's CPU ops and a sitecustomize that
  makes torch.cuda.synchronize harmless without a driver (each file says why).

`server_command()` is what `rollout.sglang.server_command` takes: the variables ride on the command
line (`env K=V ... python -m sglang.launch_server`), so they hold whatever environment the project
hands its servers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD_SCRIPT = REPO / "tools" / "sglang_cpu_venv.sh"
SERVER_PATH = HERE / "server_path"
API_KEY = "real-sglang-key-5c1d"
START_S = 240.0  # start to healthy: 47-100 s on 2 idle cores, 150-185 s on 2 cores at load 12-16
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
            "--max-total-tokens", "4096", "--dtype", "float32"]
# SGLang sizes the KV pool from the host's free memory on CPU; --max-total-tokens caps it at 4096
# tokens, and 0.05 was refused ("no memory for the KV cache") on a host whose free memory moved.
MEM_FRACTION = 0.3
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
              "PYTHONPATH": str(SERVER_PATH)}


def venv_dir() -> Path:
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--path"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def missing() -> str | None:
    """Why the real server cannot run here (with the command that fixes it), or None."""
    venv = venv_dir()
    if not (venv / ".megatron_rl_complete").is_file():
        return (f"the real SGLang server's virtual environment {venv} is not built; build it once per machine "
                f"with `{BUILD_SCRIPT.relative_to(REPO)}` (about 4.4 GB download, 11 GB on disk, 4-8 minutes)")
    return None


def python() -> str:
    return str(venv_dir() / "bin" / "python")


def server_command() -> list[str]:
    """`rollout.sglang.server_command` for the real server (arguments follow)."""
    return ["env", *(f"{k}={v}" for k, v in SERVER_ENV.items()), python(), "-m", "sglang.launch_server"]


def router_command() -> list[str]:
    return [python(), "-m", "sglang_router.launch_router"]


EXAMPLES = REPO / "examples" / "tiny"
# The tiny run every server here starts from: examples/tiny/bf16.yaml made small (the e2e tier's
# settings); its warm-started Qwen2 (64 hidden, 2 layers, 4 heads, 2 KV heads, the character
# tokenizer's 46 ids) is what `megatron-rl eval` of that config syncs into the server.
TINY = ["model.tiny_hidden_size=64", "model.tiny_ffn_hidden_size=128", "train.sft_steps=30",
        "train.sft_batch_size=16", "log.progress=false", "log.tensorboard=false", "log.plot=false",
        "checkpoint.save_final=false"]


def tiny_config(*overrides: str):
    from megatron_rl.config import load_config

    return load_config(EXAMPLES / "bf16.yaml", [*TINY, *overrides])


def make_model(root: Path) -> Path:
    """The warm-started tiny Qwen2 (config.json, safetensors, the character tokenizer) under
    root/.tiny_models, where a run with log.dir=root/<name> finds it (loop/build.py)."""
    from megatron_rl.loop.warmstart import prepare_tiny_model

    return prepare_tiny_model(tiny_config(), root / ".tiny_models")


def sglang_config(**overrides):
    """The project's SGLangConfig for launched real CPU servers (API key from the environment)."""
    from megatron_rl.rollout.sglang_config import SGLangConfig

    os.environ["MEGATRON_RL_SGLANG_API_KEY"] = API_KEY
    kw = dict(startup_timeout_s=START_S, request_timeout_s=120.0, mem_fraction_static=MEM_FRACTION,
              server_command=server_command(), router_command=router_command(), extra_args=list(CPU_ARGS))
    kw.update(overrides)
    return SGLangConfig(**kw)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


if __name__ == "__main__":  # where the venv is and whether it is usable
    print(venv_dir(), missing() or "ready", file=sys.stderr)
