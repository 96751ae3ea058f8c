"""Long waits: the gloo groups' timeout sized to the job, and the server environment that keeps a
server start short (no DeepGEMM precompile)."""

import pytest

from megatron_rl.config import load_config


def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_host_wait_timeout_is_sized_to_the_job():
    from megatron_rl.loop.build import host_wait_timeout_s

    sglang = ("rollout.engine=sglang", "rollout.sglang.startup_timeout_s=600", "rollout.sglang.max_retries=2",
              "rollout.sglang.request_timeout_s=1800")
    assert host_wait_timeout_s(_cfg(*sglang)) == 600 + 3 * 1800 + 600
    assert host_wait_timeout_s(_cfg(*sglang, "parallel.host_wait_timeout_s=9000")) == 9000
    assert host_wait_timeout_s(_cfg()) == 7200  # the embedded engine
    with pytest.raises(ValueError, match="parallel.host_wait_timeout_s"):
        _cfg(*sglang, "parallel.host_wait_timeout_s=300")  # shorter than a server start


def test_servers_start_without_the_deepgemm_precompile(monkeypatch):
    from megatron_rl.rollout.sglang_server import launch_env

    monkeypatch.delenv("SGLANG_JIT_DEEPGEMM_PRECOMPILE", raising=False)
    monkeypatch.setenv("SGLANG_JIT_DEEPGEMM_FAST_WARMUP", "false")  # an explicit choice wins
    env = launch_env()
    assert env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "false" and env["SGLANG_JIT_DEEPGEMM_FAST_WARMUP"] == "false"

