"""The GPU matrix resolves as one environment for linux x86-64 / Python 3.12: uv's resolver over
setup.py's core requirements, its gpu and modelopt extras and megatron-core's TE range, held to
constraints/gpu.txt. Package
metadata only (no CUDA, nothing built or installed); needs the package index, so outside CI it
skips without network (in CI, CI=true, a skip is a failure)."""

import ast
import os
import shutil
import socket
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest

from megatron_rl import stack

ROOT = Path(__file__).resolve().parents[2]
# sglang 0.5.23 publishes x86-64 wheels for manylinux_2_34 only (glibc >= 2.34).
PLATFORM = "x86_64-manylinux_2_34"


def _uv() -> str | None:
    try:
        from uv import find_uv_bin  # the `uv` wheel of the test extra
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def _index() -> str:
    """The package index: uv's own setting, else pip's (a CI mirror), else PyPI."""
    env = os.environ
    return (env.get("UV_DEFAULT_INDEX") or env.get("UV_INDEX_URL") or env.get("PIP_INDEX_URL")
            or "https://pypi.org/simple")


def _index_reachable(url: str) -> bool:
    parts = urlparse(url)
    if parts.scheme == "file":
        return Path(parts.path).is_dir()
    try:
        socket.create_connection((parts.hostname, parts.port or 443), timeout=5).close()
    except (OSError, TypeError):
        return False
    return True


def _need(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI=true: the matrix must be resolved here)")
        pytest.skip(why)


def _setup_requirements() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    values = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and n.targets[0].id in ("CORE", "EXTRAS")}
    # megatron-core declares its TE range only in its `dev` extra: add it (test_stack.py checks
    # SUPPORTED is that range) so a TE pin outside it is a conflict too.
    te_range = f"transformer-engine[core_cu13,pytorch]{stack.SUPPORTED['transformer-engine']}"
    return values["CORE"] + values["EXTRAS"]["gpu"] + values["EXTRAS"]["modelopt"] + [te_range]


def _resolved(lock: str) -> dict:
    pins = {}
    for line in lock.splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


@pytest.mark.timeout(600)
def test_gpu_matrix_resolves_for_linux_x86_64_python_3_12(tmp_path):
    uv = _uv()
    _need(uv is not None, "uv is not installed (pip install uv; it is in the test extra)")
    index = _index()
    _need(_index_reachable(index), f"the package index {index} is not reachable")
    (tmp_path / "in.txt").write_text("\n".join(_setup_requirements()) + "\n")
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([uv, "pip", "compile", "in.txt", "-c", str(ROOT / "constraints" / "gpu.txt"),
                          "--default-index", index, "--python-platform", PLATFORM, "--python-version", "3.12",
                          "--no-header", "--no-annotate", "-o", "lock.txt"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, f"the GPU matrix does not resolve:\n{run.stderr[-4000:]}"
    pins = _resolved((tmp_path / "lock.txt").read_text())
    assert {name: pins.get(name) for name in stack.GPU_MATRIX} == stack.GPU_MATRIX
    assert "apex" not in pins  # PyPI's apex is an unrelated package
