"""The real SGLang server tier: the project's SGLangEngine against sglang 0.5.23 running on CPU.

The server runs in its own virtual environment, built once per machine by tools/sglang_cpu_venv.sh
(real_sglang.py has the details). Without it every test here skips and names the command that builds
it; under CI=true that skip is a failure: CI builds it (.ci/run) and must run these tests.

One server at a time: the session's main server (`real_engine`) is shared by the tests; a test that
needs more (the router, a torchrun launch) starts and stops its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import real_sglang  # noqa: E402

# Per-test limit: a server start (47-80 s on 2 idle cores, more on a loaded CI host) and its work.
REAL_TIMEOUT_S = 420


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "/tests/sglang_real/" in str(item.path) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(REAL_TIMEOUT_S))


@pytest.fixture(scope="session")
def real_sglang_ready() -> None:
    why = real_sglang.missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the real SGLang server cannot run: {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def real_model(real_sglang_ready, tmp_path_factory) -> Path:
    """The checkpoint every server here starts from (real_sglang.make_model)."""
    return real_sglang.make_model(tmp_path_factory.mktemp("real_run"))


@pytest.fixture(scope="session")
def real_engine(real_model, tmp_path_factory):
    """The project's SGLangEngine on one launched real server. Disaggregated flags: colocated mode adds
    --enable-memory-saver, whose LD_PRELOAD hook (torch_memory_saver) needs libcuda.so.1 to start."""
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from sglang_testing import free_port_block

    cfg = real_sglang.sglang_config(base_port=free_port_block(1), mode="disaggregated",
                                     weight_transport="nccl")
    engine = SGLangEngine(cfg, real_model, seed=0, log_dir=tmp_path_factory.mktemp("main_server"))
    yield engine
    engine.shutdown()
