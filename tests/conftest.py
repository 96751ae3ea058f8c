"""Shared fixtures: tiny random HF model folders (llama / qwen2 / qwen3) and a 1-process Megatron setup.

The folders come from megatron_rl.models.tiny.make_tiny_hf_model (config.json + safetensors),
built once per session and per set of overrides; treat them as read-only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("doubles")))  # SGLang doubles: tests import them by name

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tiny_hf_factory(tmp_path_factory):
    """make(arch, **overrides) -> Path of a saved tiny HF model (cached per arch + overrides)."""
    from megatron_rl.models.tiny import make_tiny_hf_model

    cache: dict[str, Path] = {}

    def make(arch: str, **overrides) -> Path:
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny_{arch}")
            make_tiny_hf_model(arch, out, **overrides)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_hf_factory) -> Path:
    return tiny_hf_factory("llama")


@pytest.fixture(scope="session")
def qwen2_dir(tiny_hf_factory) -> Path:
    return tiny_hf_factory("qwen2")


@pytest.fixture(scope="session")
def qwen3_dir(tiny_hf_factory) -> Path:
    return tiny_hf_factory("qwen3")


@pytest.fixture(params=ARCHS)
def tiny_arch_dir(request, tiny_hf_factory) -> tuple[str, Path]:
    """(arch, folder) for each architecture."""
    return request.param, tiny_hf_factory(request.param)


@pytest.fixture(scope="session")
def char_model_dir(tiny_hf_factory, tmp_path_factory):
    """A tiny Qwen2 over the character tokenizer's 46 ids, with that tokenizer saved beside it."""
    import shutil

    from megatron_rl.data import build_char_tokenizer

    src = tiny_hf_factory("qwen2", vocab_size=46, initializer_range=0.3)
    out = tmp_path_factory.mktemp("char_model")
    shutil.copytree(src, out, dirs_exist_ok=True)
    build_char_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def single_parallel():
    """ParallelInfo of a 1-process gloo group with Megatron parallel_state at TP=PP=1."""
    from megatron_rl.actor.parallel import destroy_parallel, init_parallel

    info = init_parallel(1, 1, seed=0)
    yield info
    destroy_parallel()


@pytest.fixture
def parallel_restored():
    """Leave the process's parallel state as the test found it after an in-process build_run.

    build_run re-initializes Megatron's parallel_state in the default group. Where the session's
    1-process setup (single_parallel) was live before, it gets back TP=PP=1 and seed 0, else all
    is torn down: destroying the default group under a live single_parallel would break every
    later test that uses it.
    """
    import torch.distributed as dist

    from megatron_rl.actor.parallel import destroy_parallel, init_parallel

    was_initialized = dist.is_initialized()
    yield
    if was_initialized:
        init_parallel(1, 1, seed=0)
    else:
        destroy_parallel()
