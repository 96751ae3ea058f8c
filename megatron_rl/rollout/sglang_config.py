"""Settings of the SGLang rollout engine (to be nested as `rollout.sglang` in the run config)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

MODES = ("colocated", "disaggregated")
WEIGHT_TRANSPORTS = ("tensor", "nccl", "disk")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "bfloat16")
PAUSE_MODES = ("abort", "retract", "in_place")
KV_SCALES = ("calibrated", "unit", "sent")
_ANY_INTERFACE = ("0.0.0.0", "::", "")


@dataclass
class SGLangConfig:
    """How the SGLang servers are launched, reached and updated (design.md section 5)."""

    mode: str = "colocated"
    """colocated (same GPUs as the trainer; memory released while training; weights by CUDA IPC) |
    disaggregated (own nodes; weights by NCCL broadcast or disk)."""
    server_urls: list[str] = field(default_factory=list)
    """Servers started elsewhere (slurm/); empty = this process launches `num_servers` locally."""
    router_url: str = ""
    """sglang-router in front of the servers: generate() goes through it, admin calls go to each server."""
    launch_router: bool = False
    """Launch sglang-router locally in front of the launched servers (port `router_port`)."""
    router_port: int = 30999
    host: str = "127.0.0.1"
    """Interface the launched servers bind to: loopback, or the cluster interface's address.
    Never 0.0.0.0: the weight-update endpoints would be reachable from every network."""
    base_port: int = 30000
    """Server i listens on base_port + i; its torch.distributed port (SGLang's --nccl-port) is
    base_port + i + 1000 (+ 2000, 3000 ... where that is another server's, the router's, the trainer's
    MASTER_PORT, or with the nccl transport the weight group's nccl_master_port .. + 63)."""
    num_servers: int = 1
    """Servers launched by this process, one per TP group (GPUs i*tp_size .. (i+1)*tp_size-1)."""
    tp_size: int = 1
    quantization: str = ""
    """"" = as the checkpoint says (an FP8 checkpoint carries quantization_config) | "fp8" = online
    W8A8 blockwise quantization of a BF16 checkpoint at load time."""
    kv_cache_dtype: str = "auto"
    """fp8_e4m3: FP8 KV cache; every weight update must then carry fresh k_scale / v_scale tensors."""
    mem_fraction_static: float = 0.7
    """Fraction of GPU memory for weights + KV cache (lower when colocated with the trainer)."""
    api_key_env: str = "MEGATRON_RL_SGLANG_API_KEY"
    """Environment variable holding the API key (sent as `Authorization: Bearer`); never in YAML."""
    weight_transport: str = "tensor"
    """tensor (colocated, update_weights_from_tensor) | nccl (update_weights_from_distributed) | disk."""
    disk_dir: str = ""
    """Shared folder of versioned safetensors snapshots (disk transport)."""
    nccl_master_addr: str = "127.0.0.1"
    """Address of the trainer's weight-broadcast rank as the servers reach it (nccl transport)."""
    nccl_master_port: int = 29650
    max_batch_per_request: int = 64
    """Rows (prompt x sample) per /generate request."""
    requests_per_server: int = 16
    """Concurrent /generate requests per server: with max_batch_per_request rows each, up to 1024
    rows per server are in SGLang's scheduler at once, so a long rollout runs as one continuous
    batch instead of waves."""
    request_timeout_s: float = 3600.0
    startup_timeout_s: float = 900.0
    max_retries: int = 3
    """Attempts per request after the first, on other servers, when a server dies or aborts it."""
    pause_mode: str = "abort"
    """pause_generation mode: abort (in-flight requests end and are retried after the update, so no
    sample mixes two weight versions) | retract | in_place."""
    deterministic_inference: bool = False
    """Start the servers with --enable-deterministic-inference. Only then does SGLang honour the
    per-request `sampling_seed` the engine sends (sampling/sampling_batch_info.py); without it rows
    are sampled from the server's own generator (--random-seed), so reruns differ."""
    extra_args: list[str] = field(default_factory=list)
    """Extra `sglang.launch_server` arguments, e.g. ["--context-length", "20480"]."""
    server_command: list[str] = field(default_factory=list)
    """Command that starts one server, before its arguments; empty = `python -m sglang.launch_server`
    with this interpreter. For SGLang installed elsewhere, e.g. ["/opt/sglang/bin/python", "-m",
    "sglang.launch_server"] or ["apptainer", "exec", "--nv", "sglang.sif", "python3", "-m",
    "sglang.launch_server"]."""
    router_command: list[str] = field(default_factory=list)
    """Command that starts sglang-router, before its arguments; empty = `python -m
    sglang_router.launch_router` with this interpreter."""
    model_path: str = ""
    """Checkpoint the servers load. Empty = the run's HF model, converted at start into
    <log.dir>/rollout_fp8 (tools/convert_hf_to_fp8.py) when precision.rollout_quant is fp8_blockwise,
    so the servers hold FP8 parameters with weight_scale_inv that updates can overwrite."""
    router_request_timeout_s: float = 0.0
    """sglang-router's --request-timeout-secs; 0 = request_timeout_s plus a minute, so the router
    never gives up on a request the client still waits for (the router's own default is 1800 s)."""
    kv_scales: str = "calibrated"
    """FP8 KV cache scales, sent with every weight update (a colocated release discards SGLang's):
    calibrated (per-layer K/V amax / 448 recorded in the trainer's old-log-prob forward, on the
    tokens just sampled, as NeMo-RL recalibrates each step; unit until the first recording) | unit
    (SGLang's default 1.0, as slime and miles run it; logged at start) | sent (k_scale / v_scale come
    with the weights from elsewhere; every update must carry them)."""
    flush_retries: int = 60
    """/flush_cache attempts, one per second: SGLang refuses it (400) while any request runs, and a
    health-generation probe of the router can be one."""

    def api_key(self) -> str:
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ValueError(f"rollout.sglang.api_key_env: environment variable {self.api_key_env!r} is "
                             "empty; the SGLang servers require an API key")
        return key


def validate_sglang(cfg: SGLangConfig) -> SGLangConfig:
    """Raise one ValueError naming the bad key; return cfg unchanged otherwise."""
    _choice("mode", cfg.mode, MODES)
    _choice("weight_transport", cfg.weight_transport, WEIGHT_TRANSPORTS)
    _choice("kv_cache_dtype", cfg.kv_cache_dtype, KV_CACHE_DTYPES)
    _choice("pause_mode", cfg.pause_mode, PAUSE_MODES)
    _choice("kv_scales", cfg.kv_scales, KV_SCALES)
    if cfg.flush_retries < 1:
        raise ValueError(f"rollout.sglang.flush_retries: must be >= 1, got {cfg.flush_retries}")
    if cfg.quantization not in ("", "fp8"):
        raise ValueError(f"rollout.sglang.quantization: {cfg.quantization!r} is not one of ['', 'fp8']")
    if cfg.host in _ANY_INTERFACE:
        raise ValueError(f"rollout.sglang.host: {cfg.host!r} binds every interface; use 127.0.0.1 or "
                         "the cluster interface's address")
    for key in ("num_servers", "tp_size", "max_batch_per_request", "requests_per_server", "base_port"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"rollout.sglang.{key}: must be >= 1, got {getattr(cfg, key)}")
    if cfg.max_retries < 0:
        raise ValueError(f"rollout.sglang.max_retries: must be >= 0, got {cfg.max_retries}")
    if not 0.0 < cfg.mem_fraction_static < 1.0:
        raise ValueError(f"rollout.sglang.mem_fraction_static: must be in (0, 1), got {cfg.mem_fraction_static}")
    if cfg.mode == "colocated" and cfg.weight_transport == "nccl":
        raise ValueError("rollout.sglang.weight_transport: 'nccl' broadcasts to servers on other GPUs; "
                         "colocated servers take 'tensor' (CUDA IPC) or 'disk'")
    if cfg.mode == "disaggregated" and cfg.weight_transport == "tensor":
        raise ValueError("rollout.sglang.weight_transport: 'tensor' shares CUDA memory and needs colocated "
                         "servers; disaggregated servers take 'nccl' or 'disk'")
    if cfg.weight_transport == "disk" and not cfg.disk_dir:
        raise ValueError("rollout.sglang.disk_dir: the disk transport needs a folder all servers can read")
    return cfg


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"rollout.sglang.{key}: {value!r} is not one of {list(choices)}")
