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


def server_args(cfg: SGLangConfig, model_path: str, port: int, base_gpu_id: int, seed: int,
                dist_port: int | None = None) -> list[str]:
    """`sglang.launch_server` arguments of one server (one TP group), without --api-key (added by
    `build_servers`, so the key never lands in a config dump or a log of these arguments).

    dist_port: the port of its torch.distributed rendezvous (--nccl-port, from `dist_ports`); None
    leaves SGLang to draw a random free one (srt/server_args.py PortArgs.init_new)."""
    args = ["--model-path", model_path, "--host", cfg.host, "--port", str(port),
            "--tp-size", str(cfg.tp_size), "--base-gpu-id", str(base_gpu_id),
            "--mem-fraction-static", str(cfg.mem_fraction_static), "--random-seed", str(seed),
            "--kv-cache-dtype", cfg.kv_cache_dtype, "--weight-version", "0"]
    if dist_port is not None:
        args += ["--nccl-port", str(dist_port)]
    if cfg.quantization:
        args += ["--quantization", cfg.quantization]
    if cfg.deterministic_inference:
        args += ["--enable-deterministic-inference"]
    if cfg.mode == "colocated":
        args += ["--enable-memory-saver"]  # release/resume_memory_occupation need it
    return args + list(cfg.extra_args)


def server_seed(seed: int, index: int) -> int:
    """--random-seed of server `index` (numbered over the whole job, colocated and disaggregated
    alike). Distinct per server: without --enable-deterministic-inference SGLang ignores the
    per-row sampling_seed (srt/sampling/sampling_batch_info.py) and samples from the server's own
    generator, so two servers with one seed return the same tokens for the same prompt."""
    return seed + index


# A server's torch.distributed port (--nccl-port) is searched from its HTTP port + this offset.
DIST_PORT_OFFSET = 1000
# The weight group of the nccl transport moves to nccl_master_port + 1, + 2, ... after each server
# restart (sync/sglang_transport.py SGLangNcclTransport._init_group): that many ports stay reserved.
WEIGHT_GROUP_PORTS = 64


def reserved_ports(cfg: SGLangConfig) -> dict[int, str]:
    """Ports no server may take, with what holds each: the trainer's rendezvous (MASTER_PORT:
    torchrun's agent store listens there) and the router."""
    held = {cfg.router_port: "rollout.sglang.router_port"}
    master = os.environ.get("MASTER_PORT", "")
    if master.isdigit():
        held[int(master)] = f"the trainer's rendezvous port MASTER_PORT={master}"
    return held


def dist_ports(cfg: SGLangConfig, http_ports: list[int]) -> list[int]:
    """One torch.distributed port per server: SGLang's scheduler always rendezvouses on
    tcp://<host>:<nccl_port> (srt/distributed/bootstrap.py _resolve_dist_init_method, then
    parallel_state.py init_process_group), tp = 1 included. Left to SGLang, the port is drawn at
    random from 22000-29999 (utils/network.py get_free_port_below_ephemeral), the range of
    torchrun's MASTER_PORT; two servers starting together can draw the same. Chosen here: HTTP
    port + DIST_PORT_OFFSET, or + 2 x, 3 x ... the offset where that is reserved (reserved_ports)
    or taken, so a moved port never lands on the next server's (two launchers of one host whose
    HTTP ports are not a multiple of the offset apart never collide either)."""
    for flag in ("--nccl-port", "--dist-init-addr", "--nccl-init-addr"):
        if flag in cfg.extra_args:
            raise ValueError(f"rollout.sglang.extra_args: {flag} is set by the launcher (one distinct port "
                             "per server, never the trainer's rendezvous port); remove it")
    held = reserved_ports(cfg)
    for port in http_ports:
        if port in held:
            raise ValueError(f"rollout.sglang.base_port: server port {port} is {held[port]}; choose another base_port")
    if cfg.weight_transport == "nccl":  # the weight group's store listens on the trainer's host
        held.update(dict.fromkeys(range(cfg.nccl_master_port, cfg.nccl_master_port + WEIGHT_GROUP_PORTS)))
    chosen: list[int] = []
    for port in http_ports:
        candidate = port + DIST_PORT_OFFSET
        while candidate in held or candidate in http_ports or candidate in chosen:
            candidate += DIST_PORT_OFFSET
        if candidate > 65535:
            raise ValueError(f"rollout.sglang.base_port: no free dist port above {port} (ports end at 65535)")
        chosen.append(candidate)
    return chosen


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
    down: bool = field(default=False, compare=False)
    """Found dead by a pause or a memory call: left out of every update and memory call until the
    next generate() restarts it (SGLangEngine._restart_down)."""

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


# What torchrun puts in its workers' environment (torch/distributed/elastic/agent/server/
# local_elastic_agent.py LocalElasticAgent._start_workers and _set_local_rank_env; the agent's own
# TORCHELASTIC_* from elastic/multiprocessing/api.py and launcher/api.py). A server started from a
# worker must see none of it: with TORCHELASTIC_USE_AGENT_STORE=True torch's tcp:// rendezvous makes
# every rank a store client (torch/distributed/rendezvous.py _create_c10d_store), so SGLang's
# scheduler, rank 0 of its own world, waits for a store nobody starts. TORCH_NCCL_ASYNC_ERROR_HANDLING
# is kept: torchrun only defaults it, and a user's value is meant for every NCCL process.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_PREFIXES = ("TORCHELASTIC_",)


def launch_env() -> dict[str, str]:
    """The environment of a launched server or router: this process's, without torchrun's."""
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARS and not k.startswith(TORCHRUN_PREFIXES)}
    for key, value in SERVER_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return env


def build_servers(cfg: SGLangConfig, model_path: str, api_key: str, seed: int = 0,
                  log_dir: Path | None = None, argv_fn=None) -> list[Server]:
    """The engine's servers: the configured URLs, or `num_servers` launched here (not yet started).

    seed: server i gets --random-seed server_seed(seed, i) (a caller launching part of a job's
    servers passes seed + the index of its first). argv_fn(port, base_gpu_id) -> argv overrides
    the whole command line (tests use it to give one server of several a different flag).
    """
    if cfg.server_urls:
        return [Server(SGLangClient(u, api_key, cfg.request_timeout_s), cfg.tp_size) for u in cfg.server_urls]
    http = [cfg.base_port + i for i in range(cfg.num_servers)]
    dist = dist_ports(cfg, http) if argv_fn is None else [None] * len(http)
    servers = []
    for i, (port, dist_port) in enumerate(zip(http, dist)):
        gpu = i * cfg.tp_size
        if argv_fn is not None:
            argv = argv_fn(port, gpu)
        else:
            args = server_args(cfg, model_path, port, gpu, server_seed(seed, i), dist_port)
            argv = _sglang.server_argv(args + ["--api-key", api_key], cfg.server_command)
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
