"""SGLang server and router processes: command lines, start, health wait, restart, stop."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.rollout import _sglang
from megatron_rl.rollout.sglang_client import SGLangClient
from megatron_rl.rollout.sglang_config import SGLangConfig


def server_args(cfg: SGLangConfig, model_path: str, port: int, base_gpu_id: int, seed: int) -> list[str]:
    """`sglang.launch_server` arguments of one server (one TP group), without --api-key (added by
    `build_servers`, so the key never lands in a config dump or a log of these arguments)."""
    args = ["--model-path", model_path, "--host", cfg.host, "--port", str(port),
            "--tp-size", str(cfg.tp_size), "--base-gpu-id", str(base_gpu_id),
            "--mem-fraction-static", str(cfg.mem_fraction_static), "--random-seed", str(seed),
            "--kv-cache-dtype", cfg.kv_cache_dtype, "--weight-version", "0"]
    if cfg.quantization:
        args += ["--quantization", cfg.quantization]
    if cfg.deterministic_inference:
        args += ["--enable-deterministic-inference"]
    if cfg.mode == "colocated":
        args += ["--enable-memory-saver"]  # release/resume_memory_occupation need it
    return args + list(cfg.extra_args)


def router_args(cfg: SGLangConfig, worker_urls: list[str]) -> list[str]:
    """sglang-router arguments, without --api-key (added where the key is at hand, like the servers').

    --request-timeout-secs: the router's default (1800 s) is below the client's request timeout, so a
    long rollout tail would be cut by the router while the client still waits."""
    timeout = cfg.router_request_timeout_s or cfg.request_timeout_s + 60.0
    return ["--worker-urls", *worker_urls, "--host", cfg.host, "--port", str(cfg.router_port),
            "--policy", "cache_aware", "--request-timeout-secs", str(int(timeout))]


@dataclass
class ManagedProcess:
    """A child process we started and may restart with the same command line."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            if self.log_path:
                log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of its log ("" without one), for an error that says why it exited."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if not self.alive():
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)


@dataclass
class Server:
    """One SGLang server as the engine sees it. `version` is the weight version it holds."""

    client: SGLangClient
    tp_size: int = 1
    process: ManagedProcess | None = None
    version: int = 0
    restarts: int = 0
    in_flight: int = field(default=0, compare=False)

    @property
    def url(self) -> str:
        return self.client.url


# SGLang 0.5.23 precompiles DeepGEMM kernels for every M up to 16K before serving when
# SGLANG_JIT_DEEPGEMM_PRECOMPILE is on (its default, srt/environ.py:1369), "typically 10-20 mins"
# (srt/layers/deep_gemm_wrapper/compile_utils.py:158-178) and again whenever the job's cache folder
# is fresh; slime turns it off and warms up fast instead (compile_utils.py:47). Kernels then compile
# on first use of each shape. An explicit value in the environment wins.
SERVER_ENV_DEFAULTS = {
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",  # /health = liveness only
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_JIT_DEEPGEMM_FAST_WARMUP": "true",
}


# torchrun tells its workers to rendezvous through its agent's store: with this set, torch's tcp://
# rendezvous (torch/distributed/rendezvous.py _create_c10d_store) makes only a CLIENT of the store,
# so a server started from a torchrun worker waited forever for a master in its own
# init_process_group(init_method="tcp://...") and in /init_weights_update_group.
TORCHRUN_ONLY_ENV = ("TORCHELASTIC_USE_AGENT_STORE",)


def launch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ONLY_ENV}
    for key, value in SERVER_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return env


def build_servers(cfg: SGLangConfig, model_path: str, api_key: str, seed: int = 0,
                  log_dir: Path | None = None, argv_fn=None) -> list[Server]:
    """The engine's servers: the configured URLs, or `num_servers` launched here (not yet started).

    argv_fn(port, base_gpu_id) -> argv overrides the whole command line (tests use it to give one
    server of several a different flag).
    """
    if cfg.server_urls:
        return [Server(SGLangClient(u, api_key, cfg.request_timeout_s), cfg.tp_size) for u in cfg.server_urls]
    servers = []
    for i in range(cfg.num_servers):
        port, gpu = cfg.base_port + i, i * cfg.tp_size
        if argv_fn is not None:
            argv = argv_fn(port, gpu)
        else:
            argv = _sglang.server_argv(server_args(cfg, model_path, port, gpu, seed) + ["--api-key", api_key],
                                       cfg.server_command)
        log = log_dir / f"sglang_server_{i}.log" if log_dir else None
        proc = ManagedProcess(argv, launch_env(), log)
        client = SGLangClient(f"http://{cfg.host}:{port}", api_key, cfg.request_timeout_s)
        servers.append(Server(client, cfg.tp_size, proc))
    return servers


def wait_healthy(servers: list[Server], timeout_s: float, poll_s: float = 0.5) -> None:
    """Block until every server answers /health; RuntimeError naming the first that never does."""
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while not server.client.healthy("/health", timeout_s=5.0):
            if server.process is not None and not server.process.alive():
                raise RuntimeError(f"SGLang server {server.url} exited during startup "
                                   f"(exit code {server.process.proc.returncode}){_log_end(server)}")
            if time.monotonic() > deadline:  # still loading, or stuck: what it printed last says which
                raise RuntimeError(f"SGLang server {server.url} not healthy after {timeout_s:.0f} s{_log_end(server)}")
            time.sleep(poll_s)


def _log_end(server: Server) -> str:
    """The end of a launched server's log, for an error about its start."""
    if server.process is None:
        return ""
    log = server.process.log_path
    if log is None:
        return " (no log kept)"
    tail = server.process.log_tail()
    return f"; the end of {log}:\n{tail}" if tail else f"; {log} is empty"
