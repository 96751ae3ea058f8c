"""algo/ stays pure torch: no torch.distributed, megatron, transformer_engine or sglang imports."""

import ast
from pathlib import Path

import pytest

ALGO_DIR = Path(__file__).resolve().parents[2] / "megatron_rl" / "algo"
FORBIDDEN = ("torch.distributed", "megatron", "transformer_engine", "sglang", "apex", "vllm")
ALLOWED_ROOTS = {"torch", "megatron_rl", "__future__", "math", "collections", "typing", "dataclasses", "functools"}


def _imported_modules(source: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names.append(module)
            # `from torch import distributed` imports torch.distributed too.
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def _is_forbidden(name: str) -> bool:
    return any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)


def test_algo_has_files():
    assert len(list(ALGO_DIR.glob("*.py"))) >= 5


@pytest.mark.parametrize("path", sorted(ALGO_DIR.rglob("*.py")), ids=lambda p: p.name)
def test_algo_imports_only_torch_and_stdlib(path):
    names = _imported_modules(path.read_text())
    bad = [n for n in names if _is_forbidden(n)]
    assert not bad, f"{path.name} imports {bad}"
    roots = {n.split(".")[0] for n in names if n}
    assert roots <= ALLOWED_ROOTS, f"{path.name} imports outside torch/stdlib: {roots - ALLOWED_ROOTS}"
    internal = [n for n in names if n.startswith("megatron_rl.") and not n.startswith("megatron_rl.algo")]
    assert not internal, f"{path.name} imports other megatron_rl layers: {internal}"


def test_detector_catches_forbidden_forms():
    src = "import torch.distributed as dist\nfrom torch import distributed\nimport megatron.core\nfrom sglang import x\n"
    assert [n for n in _imported_modules(src) if _is_forbidden(n)] == [
        "torch.distributed", "torch.distributed", "megatron.core", "sglang", "sglang.x"
    ]
    assert not _is_forbidden("torch.nn") and not _is_forbidden("megatron_rl.algo.kl")
