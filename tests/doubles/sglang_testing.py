"""Start SGLangEngine on SGLang server doubles (subprocesses on loopback); test helper."""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

import sglang_protocol

DOUBLES = Path(__file__).resolve().parent

SERVER_COMMAND = [sys.executable, str(DOUBLES / "sglang_server_double.py")]
ROUTER_COMMAND = [sys.executable, str(DOUBLES / "sglang_router_double.py")]
API_KEY = "test-key-7f3a"
# How long a server double may take to answer /health: 5-10 s on an idle 2-core host, over 60 s
# seen on a loaded CI host (it imports torch and transformers and builds the model).
START_S = 300.0
DOUBLES_TIMEOUT_S = START_S + 300  # pytest-timeout for a test that starts server doubles: their start and its work

needs_sglang_source = pytest.mark.skipif(
    sglang_protocol.sglang_root() is None,
    reason="sglang not installed (make setup installs it with --no-deps)")


_HANDED_OUT: set[int] = set()


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports on 127.0.0.1, for servers a test starts later.

    Drawn below the kernel's ephemeral range: a port found free there can be taken by any outgoing
    connection (an HTTP client, a gloo peer) before the server binds it, and the server then exits
    at start-up. A port this process handed out before is never handed out again.
    """
    floor = _ephemeral_floor()
    rng = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(20000, max(floor, 20000 + 2 * n) - n)
        block = range(base, base + n)
        if not _HANDED_OUT.intersection(block) and all(_free(p) for p in block):
            _HANDED_OUT.update(block)
            return base
    raise RuntimeError(f"no block of {n} free ports below {floor} on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_double(model_dir: Path, *flags: str):
    """One server double on a free port, healthy by the engine's own wait (`wait_healthy`, which
    names a double that exits and shows its log): (its Popen, its URL); the caller kills it."""
    from megatron_rl.rollout.sglang_client import SGLangClient
    from megatron_rl.rollout.sglang_server import ManagedProcess, Server, wait_healthy

    port = free_port_block(1)
    proc = ManagedProcess([*SERVER_COMMAND, "--model-path", str(model_dir), "--port", str(port),
                           "--api-key", API_KEY, *flags], dict(os.environ),
                          Path(tempfile.mkdtemp(prefix="sglang_double_")) / "server.log")
    proc.start()
    server = Server(SGLangClient(f"http://127.0.0.1:{port}", API_KEY, timeout_s=60), process=proc)
    try:
        wait_healthy([server], START_S)
    except RuntimeError:
        proc.stop()
        raise
    return proc.proc, server.url


def double_argv(cfg, model_dir: Path, extra_by_server: dict[int, list[str]] | None = None):
    """argv_fn for SGLangEngine: the project's own server flags, plus extra_by_server[i] for server i."""
    from megatron_rl.rollout.sglang_server import server_args

    extra_by_server = extra_by_server or {}

    def argv(port: int, base_gpu_id: int) -> list[str]:
        index = base_gpu_id // cfg.tp_size
        return [*SERVER_COMMAND, *server_args(cfg, str(model_dir), port, base_gpu_id, seed=index),
                "--api-key", API_KEY, *extra_by_server.get(index, [])]

    return argv


def make_engine(model_dir: Path, num_servers: int = 1, extra_by_server=None, **cfg_kw):
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    os.environ["MEGATRON_RL_SGLANG_API_KEY"] = API_KEY
    cfg_kw.setdefault("base_port", free_port_block(num_servers))
    cfg = SGLangConfig(num_servers=num_servers, startup_timeout_s=START_S, request_timeout_s=120.0,
                       server_command=SERVER_COMMAND, router_command=ROUTER_COMMAND, **cfg_kw)
    argv_fn = double_argv(cfg, model_dir, extra_by_server) if extra_by_server else None
    return SGLangEngine(cfg, model_dir, argv_fn=argv_fn)


def assert_no_generation_while_paused(record: Path, mode: str) -> None:
    """The server doubles' request records (SGLANG_DOUBLE_RECORD=<record>, one file per server),
    per server: no /generate arrives while it is paused, inside an update session or released;
    the weight version that generation sees only moves forward and moves (the updates land); in the
    disaggregated layout every weight update arrives while generation is paused."""
    files = sorted(record.glob("*.jsonl"))  # one per server (the router double records nothing)
    served, seen_versions = 0, set()
    for f in files:
        events = [json.loads(line) for line in f.read_text().splitlines()]
        generate = [e for e in events if e["path"] == "/generate"]
        served += len(generate)
        if not generate:  # the router's cache-aware policy may keep one server idle at this size
            continue
        bad = [e for e in generate if e["paused"] or e["update_session"] or e["released"]]
        assert not bad, (f.name, bad[:3])
        versions = [e["weight_version"] for e in generate]
        order = list(dict.fromkeys(versions))  # first-seen order of the versions
        seen_versions.update(order)
        # versions come in blocks, in order: once a newer one is served, an older one never returns
        assert all(order.index(a) <= order.index(b) for a, b in zip(versions, versions[1:])), (f.name, versions)
        if mode == "disaggregated":
            updates = [e for e in events if e["path"].startswith("/update_weights_from")]
            assert updates and all(e["paused"] for e in updates), (f.name, [e for e in updates if not e["paused"]][:3])
    # the updates land: rows batched per request, the router may send one server only one step's
    assert served > 0 and len(seen_versions) >= 2, seen_versions
