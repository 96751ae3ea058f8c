"""Start SGLangEngine on protocol-conformance servers (subprocesses on loopback); test helper."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

import sglang_protocol

SERVER = Path(__file__).with_name("sglang_conformance_server.py")
API_KEY = "test-key-7f3a"

needs_sglang_source = pytest.mark.skipif(
    sglang_protocol.sglang_root() is None,
    reason="sglang not installed (make setup installs it with --no-deps)")


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65000 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port block")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def conformance_argv(model_dir: Path, extra_by_server: dict[int, list[str]] | None = None,
                     rollout_quant: str = "bf16"):
    """argv_fn for SGLangEngine: server i runs the conformance server with extra_by_server[i]."""
    extra_by_server = extra_by_server or {}

    def argv(port: int, base_gpu_id: int) -> list[str]:
        index = base_gpu_id  # tp_size 1: server i has base GPU i
        return [sys.executable, str(SERVER), "--model", str(model_dir), "--port", str(port),
                "--api-key", API_KEY, "--rollout-quant", rollout_quant, *extra_by_server.get(index, [])]

    return argv


def make_engine(model_dir: Path, num_servers: int = 1, extra_by_server=None, rollout_quant: str = "bf16", **cfg_kw):
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    os.environ["MEGATRON_RL_SGLANG_API_KEY"] = API_KEY
    cfg = SGLangConfig(num_servers=num_servers, base_port=free_port_block(num_servers),
                       startup_timeout_s=120.0, request_timeout_s=120.0, **cfg_kw)
    return SGLangEngine(cfg, model_dir, argv_fn=conformance_argv(model_dir, extra_by_server, rollout_quant))
