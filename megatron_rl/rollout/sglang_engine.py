"""The production rollout engine: SGLang servers (FP8 W8A8, FP8 KV cache) behind the engine protocol.

Usage (colocated; transports in megatron_rl.sync drive the weight updates)::

    engine = SGLangEngine(SGLangConfig(), model_path="/ckpt/qwen3-8b-fp8")   # launches, waits healthy
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16384, n=8))
    engine.release_memory()          # colocated: free weights + KV cache while the trainer trains
    engine.resume_memory()
    sync.sync()                      # pause -> flush -> buckets -> continue, engine at version v+1

Fault handling: a /generate request that fails because its server died (or aborted it) is retried
on another server holding the current weights; a dead server this process launched is restarted
with the same command line. A restarted server holds the checkpoint's weights, so it gets no
requests until the next weight update reaches it (every update is a full one). A server found dead
by a pause or a memory call is left out of that update and restarted by the next generate(), never
inside a sync. Every response's `weight_version` is checked: a sample is never taken from stale weights.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

from megatron_rl.rollout import _sglang
from megatron_rl.rollout.base import RolloutEngine, Sample, SamplingParams
from megatron_rl.rollout.sglang_client import SGLangClient, SGLangHTTPError, ServerUnavailable
from megatron_rl.rollout.sglang_config import SGLangConfig, validate_sglang
from megatron_rl.rollout.sglang_server import (ManagedProcess, Server, build_servers, launch_env,
                                               router_args, wait_healthy)

log = logging.getLogger("megatron_rl.rollout.sglang")
KV_SCALE_LEAVES = ("k_scale", "v_scale")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # a release without tags: srt/constants.py GPU_MEMORY_ALL_TYPES
# SGLang versions this engine was tested against (their weight-update protocol: the update session of
# begin_weight_update / end_weight_update, weight_version on every update, flattened buckets).
SUPPORTED_VERSIONS = ("0.5.23",)


class RolloutUnavailableError(RuntimeError):
    """No server with the current weights can serve: re-sync the weights and retry the step."""


class RolloutRequestError(RuntimeError):
    """A server or the router refused a /generate request (4xx): another attempt would be refused
    the same way, so it is reported, never retried."""


class _Retryable(RuntimeError):
    pass


# 408 (request timeout) and 429 (the router's queue is full) pass with time; other 4xx do not.
RETRY_4XX = (408, 429)
_REFUSAL_HINTS = {
    401: "the API key (MEGATRON_RL_SGLANG_API_KEY) differs from the servers' / router's --api-key",
    403: "the API key (MEGATRON_RL_SGLANG_API_KEY) differs from the servers' / router's --api-key",
    400: "the request does not fit the server's GenerateReqInput",
    422: "the request does not fit sglang-router's typed GenerateRequest (a single sampling_params "
         "object, input_ids a list or a list of lists)",
}


class SGLangEngine(RolloutEngine):
    """SGLang servers as one RolloutEngine (see the module docstring).

    Args:
        cfg: SGLangConfig (validated here).
        model_path: HF checkpoint the servers load (FP8 checkpoint, or BF16 with quantization="fp8").
        seed: server random seed; per-row sampling seeds derive from SamplingParams.seed.
        log_dir: where launched servers write their logs.
        argv_fn: (port, base_gpu_id) -> argv replacing `python -m sglang.launch_server ...`.
        start: launch and wait for the servers now.
    """

    def __init__(self, cfg: SGLangConfig, model_path: str | Path, *, seed: int = 0,
                 log_dir: Path | None = None, argv_fn=None, start: bool = True):
        self.cfg = validate_sglang(cfg)
        self.servers = build_servers(cfg, str(model_path), cfg.api_key(), seed, log_dir, argv_fn)
        self.router: SGLangClient | None = None
        self._router_proc: ManagedProcess | None = None
        self._log_dir = log_dir
        self._version = 0
        self._pending: int | None = None
        self._session_open = False
        self._kv_scales_sent: set[str] = set()
        self._weights_released = False  # since the last update: FP8 KV scales went with them
        self._released: set[str] = set()  # memory tags released on every live server now
        self._lock = threading.Lock()
        self._restart_locks = {id(s): threading.Lock() for s in self.servers}
        self.stats = {"retries": 0, "restarts": 0, "requests": 0}
        self._closed = False  # shutdown() ran: no more restarts
        if start:
            self.start()

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Launch what this process owns and wait for every server (and the router); on any failure,
        stop what was launched before raising: a failed start leaves no server holding its GPU."""
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        for s in self.servers:
            if s.process is not None:
                s.process.start()
        wait_healthy(self.servers, self.cfg.startup_timeout_s)
        self.server_versions = [check_server_info(s, self.cfg) for s in self.servers]
        if self.cfg.kv_cache_dtype.startswith("fp8") and self.cfg.kv_scales == "unit":
            log.warning("FP8 KV cache (%s) with SGLang's unit k/v scales (1.0), as slime and miles run it; "
                        "set rollout.sglang.kv_scales=sent to send recalibrated scales", self.cfg.kv_cache_dtype)
        if self.cfg.router_url:
            self.router = SGLangClient(self.cfg.router_url, self.cfg.api_key(), self.cfg.request_timeout_s)
        elif self.cfg.launch_router:
            self._start_router()

    def _start_router(self) -> None:
        argv = _sglang.router_argv(router_args(self.cfg, [s.url for s in self.servers])
                                   + ["--api-key", self.cfg.api_key()], self.cfg.router_command)
        log_path = self._log_dir / "sglang_router.log" if self._log_dir else None
        self._router_proc = ManagedProcess(argv, launch_env(), log_path)
        self._router_proc.start()
        self.router = SGLangClient(f"http://{self.cfg.host}:{self.cfg.router_port}", self.cfg.api_key(),
                                   self.cfg.request_timeout_s)
        wait_healthy([Server(self.router, process=self._router_proc)], self.cfg.startup_timeout_s)

    def shutdown(self) -> None:
        """Stop what this process launched. May run on another thread (a SIGTERM watcher) while a
        request's failure restarts a server: `_closed` is set first, so that restart stops its own
        process (see _check_server) or this loop sees the new one."""
        self._closed = True
        for proc in [s.process for s in self.servers] + [self._router_proc]:
            if proc is not None:
                proc.stop()

    # ---- generation ----------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """n samples per prompt, contiguous by prompt, each with the engine's per-token log-probs."""
        if self._pending is not None:
            raise RuntimeError(f"generate() during the update to version {self._pending}")
        self._restart_down()
        rows = [(i, list(p), r) for i, p in enumerate(prompts) for r in range(sampling.n)]
        seeded = self.cfg.deterministic_inference
        chunks = request_chunks(rows, sampling, self.cfg.max_batch_per_request, per_row_seed=seeded)
        workers = max(1, len(self.servers) * self.cfg.requests_per_server)
        with ThreadPoolExecutor(max_workers=min(workers, max(1, len(chunks)))) as pool:
            results = list(pool.map(lambda c: self._run_chunk(c, sampling, seeded), chunks))
        return [s for chunk in results for s in chunk]

    def _run_chunk(self, rows, sampling: SamplingParams, seeded: bool) -> list[Sample]:
        body = _generate_body(rows, sampling, per_row_seed=seeded)
        for attempt in range(self.cfg.max_retries + 1):
            server = self._pick_server()
            client = self.router or server.client
            try:
                out = client.post("/generate", body)
                return [self._to_sample(row, item) for row, item in zip(rows, _as_list(out, len(rows)))]
            except (ServerUnavailable, _Retryable, SGLangHTTPError) as err:
                if isinstance(err, SGLangHTTPError) and err.status < 500 and err.status not in RETRY_4XX:
                    raise RolloutRequestError(_refused_message(client.url, err)) from err
                with self._lock:
                    self.stats["retries"] += 1
                log.warning("generate on %s failed (attempt %d): %s", client.url, attempt + 1, err)
            finally:
                with self._lock:
                    server.in_flight -= 1
            self._check_server(server)
        raise RolloutUnavailableError(f"a /generate request failed {self.cfg.max_retries + 1} times (stale or "
                                      "dead servers); re-sync the weights and retry the step")

    def _pick_server(self) -> Server:
        with self._lock:
            current = [s for s in self.servers if s.version == self._version]
            if not current:
                raise RolloutUnavailableError(
                    f"no SGLang server holds weight version {self._version} (restarted servers hold the "
                    "checkpoint until the next weight update); re-sync the weights and retry the step")
            # Ties go to the first: the placement lists this rank's own server first (servers_for).
            server = min(current, key=lambda s: s.in_flight)
            server.in_flight += 1
            self.stats["requests"] += 1
            return server

    def _to_sample(self, row, item: dict) -> Sample:
        index, prompt, _ = row
        meta = item["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length"):
            raise _Retryable(f"request ended with finish_reason {meta.get('finish_reason')}")
        if self._version and str(meta.get("weight_version")) != str(self._version):
            raise _Retryable(f"sample from weight version {meta.get('weight_version')!r}, "
                             f"expected {self._version}")
        ids = [int(t) for t in item["output_ids"]]
        token_logprobs = meta["output_token_logprobs"]  # [[logprob, token_id, text|None], ...]
        if [int(e[1]) for e in token_logprobs] != ids:
            raise ValueError("SGLang output_token_logprobs do not match output_ids")
        return Sample(index, prompt, ids, [float(e[0]) for e in token_logprobs], reason)

    def _restart_down(self) -> None:
        """Restart the servers a pause or a memory call found dead, before sampling: outside any sync."""
        for server in self.servers:
            if server.down:
                self._check_server(server)

    def _mark_down(self) -> None:
        """Take servers that do not answer /health out of the update and memory calls that follow,
        without restarting them: a restart inside a sync waits up to startup_timeout_s while the
        trainer's other ranks sit in the export's collectives (NCCL's watchdog: 10 minutes)."""
        live = [s for s in self.servers if not s.down]
        with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
            healthy = list(pool.map(lambda s: s.client.healthy("/health"), live))
        for server, ok in zip(live, healthy):
            if not ok:
                log.error("SGLang server %s is not answering: left out until the next generate() restarts it",
                          server.url)
                with self._lock:
                    server.version, server.down = -1, True

    def _live(self) -> list[Server]:
        return [s for s in self.servers if not s.down]

    def _check_server(self, server: Server) -> None:
        """Take a dead server out of rotation; restart it when this process launched it."""
        if server.client.healthy("/health"):
            server.down = False  # back (restarted elsewhere): it takes part in the next update
            return
        with self._lock:
            server.version = -1  # holds no trained weights until the next full update
        if server.process is None or self._closed:
            log.error("SGLang server %s is not answering (not restarted: %s)", server.url,
                      "shutting down" if self._closed else "not launched here")
            return
        lock = self._restart_locks[id(server)]
        if not lock.acquire(blocking=False):
            return  # another request's failure is restarting it already
        try:
            log.warning("SGLang server %s is dead; restarting it", server.url)
            server.process.stop(timeout_s=10.0)
            server.process.start()
            if self._closed:  # shutdown() ran meanwhile and may have missed this process
                server.process.stop()
                return
            wait_healthy([server], self.cfg.startup_timeout_s)
            if self._released:  # as released as its peers: the next resume restores what it names
                server.client.post("/release_memory_occupation", {"tags": sorted(self._released)})
            with self._lock:
                server.down = False
                server.restarts += 1
                self.stats["restarts"] += 1
                if self._version == 0:
                    server.version = 0  # nothing trained yet: the checkpoint is current
        finally:
            lock.release()

    # ---- weight updates ------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def broadcast(self, path: str, body: dict | None = None, servers: list[Server] | None = None) -> list:
        """POST `path` to every (given) server concurrently; raise on the first failure. SGLang
        answers a failed weight-update or memory request with HTTP 400 and {"success": false}
        (entrypoints/http_server.py), which the client raises as SGLangHTTPError."""
        targets = self._live() if servers is None else servers
        with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
            return list(pool.map(lambda s: s.client.post(path, body or {}), targets))

    def begin_update(self, version: int, session: bool = True) -> None:
        if version <= self._version:
            raise ValueError(f"weight version {version} is not newer than the engine's {self._version}")
        if self._pending not in (None, version):
            raise ValueError(f"version {version} while the update to {self._pending} is in progress")
        self._pending = version
        self._kv_scales_sent = set()
        self._session_open = session  # update_weights_from_disk reloads outside a session
        if session:
            self.open_sessions()

    def open_sessions(self) -> None:
        """POST /begin_weight_update on every server: SGLang 0.5.23 refuses update_weights_from_tensor /
        _from_distributed outside a session (scheduler_components/weight_updater.py). A session a
        failed sync left open is closed first, so one failure does not block every later sync."""
        def begin(server: Server):  # a refusal is an HTTP 400 (http_server.py:1458-1470)
            try:
                return server.client.post("/begin_weight_update")
            except SGLangHTTPError as err:
                if "already open" not in err.body:
                    raise
                log.warning("%s: closing a weight-update session left open by a failed sync", server.url)
                server.client.post("/end_weight_update")
                return server.client.post("/begin_weight_update")

        live = self._live()
        with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
            list(pool.map(begin, live))

    def note_sent(self, names: Iterable[str]) -> None:
        """Transports report what reached every server (FP8 KV scales are checked at finish)."""
        self._kv_scales_sent.update(n for n in names if n.rpartition(".")[2] in KV_SCALE_LEAVES)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """One bucket through update_weights_from_tensor (single-GPU servers; see sync.sglang_transport)."""
        from megatron_rl.rollout.sglang_payload import LOAD_FORMAT, flatten_bucket, serialize_flattened

        if any(s.tp_size > 1 for s in self.servers):
            raise ValueError("rollout.sglang.tp_size > 1: every TP rank needs its own payload; use "
                             "megatron_rl.sync.sglang_transport.SGLangTensorTransport with a gather")
        if self._pending is None:
            self.begin_update(version)
        bucket = list(named_tensors)
        flat, meta = flatten_bucket(bucket)
        payload = serialize_flattened(flat, meta)
        # One payload per server (each has one TP rank, checked above). No flush per bucket: SGLang
        # fails the update when a request runs or waits at its flush (weight_updater.py:120-133 of
        # scheduler_components); finish_update flushes once, retried.
        self.broadcast("/update_weights_from_tensor", {
            "serialized_named_tensors": [payload], "load_format": LOAD_FORMAT,
            "flush_cache": False, "weight_version": str(version)})
        self.note_sent(n for n, _ in bucket)

    def update_weights_from_disk(self, path: str | Path, version: int) -> None:
        """Load a published safetensors folder (megatron_rl.sync.disk_transport) on every server."""
        index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
        self.pause()
        self.begin_update(version, session=False)
        self.broadcast("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})
        self.note_sent(index["weight_map"])
        self.finish_update(version)
        self.resume()

    def finish_update(self, version: int) -> None:
        """Every bucket is in: check FP8 KV scales came along, flush the radix cache, adopt `version`."""
        if self._pending != version:
            raise ValueError(f"finish_update({version}) but the update in progress is {self._pending}")
        fp8_kv = self.cfg.kv_cache_dtype.startswith("fp8")
        if fp8_kv and not self._kv_scales_sent and (self.cfg.kv_scales != "unit" or self._weights_released):
            # k_scale / v_scale live in SGLang's weight memory (layers/quantization/kv_cache.py:32-46):
            # a weights release discards them, and the update's end re-derives the scales attention
            # uses from that memory (kv_cache.py:51-82): they must come with the update.
            raise ValueError(f"version {version}: an FP8 KV cache needs k_scale/v_scale tensors with this update "
                             f"(rollout.sglang.kv_scales={self.cfg.kv_scales!r}"
                             f"{', weights released since the last one' if self._weights_released else ''}); "
                             "stale KV scales silently corrupt attention")
        if self._session_open:
            self.broadcast("/end_weight_update")
            self._session_open = False
        self.flush_cache()
        with self._lock:
            for s in self._live():  # a server down since the pause missed the update
                s.version = version
            self._version, self._pending = version, None
            self._weights_released = False

    def flush_cache(self, retry_s: float = 1.0) -> None:
        """/flush_cache on every server, retried: SGLang answers 400 while any request runs or waits,
        and a health-generation probe (of the router, or SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION)
        can be one at any moment (slime retries the same way)."""
        def flush(server: Server):
            for attempt in range(self.cfg.flush_retries):
                try:
                    return server.client.post("/flush_cache")
                except SGLangHTTPError as err:
                    if err.status != 400 or attempt + 1 == self.cfg.flush_retries:
                        raise
                    log.info("%s: flush_cache refused (%s); retrying", server.url, err.body.strip()[:80])
                    time.sleep(retry_s)

        live = self._live()
        with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
            list(pool.map(flush, live))

    def pause(self) -> None:
        """Stop generation on every live server. One found dead is left out of the update that follows
        (never restarted here: see _mark_down); the next generate() restarts it, and it holds the
        checkpoint until the update after that reaches it."""
        self._mark_down()
        self.broadcast("/pause_generation", {"mode": self.cfg.pause_mode})

    def follow_version(self, version: int) -> None:
        """A client of servers another rank updates: that rank's update to `version` is over (the
        world barrier at the end of WeightSync.sync), so every sample must now carry it."""
        with self._lock:
            self._version = version
            for s in self.servers:
                s.version = version

    def resume(self) -> None:
        self.broadcast("/continue_generation")

    def release_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """Colocated: free weights and/or KV cache (SGLang discards the weights: a full update
        follows). Tags as ReleaseMemoryOccupationReqInput.tags (managers/io_struct.py)."""
        self._mark_down()
        self.broadcast("/release_memory_occupation", {"tags": list(tags)} if tags else {})
        self._weights_released |= not tags or "weights" in tags
        self._released |= set(tags or MEMORY_TAGS)

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """Restore `tags` on the live servers (SGLang refuses to resume a tag that is not released:
        a restarted server is released to match its peers, see _check_server)."""
        self._mark_down()
        self.broadcast("/resume_memory_occupation", {"tags": list(tags)} if tags else {})
        self._released -= set(tags or MEMORY_TAGS)

    def check_weights(self) -> list[dict]:
        """SGLang's /weights_checker checksum of what every server holds (one reply per server)."""
        return self.broadcast("/weights_checker", {"action": "checksum"})

    def checksum(self, names: Iterable[str] | None = None) -> dict[str, str]:
        raise NotImplementedError(
            "SGLang fuses (qkv, gate_up) and TP-shards what it holds, so HF-named digests cannot be read "
            "back; the SGLang transports check updates with check_weights() instead")


def _refused_message(url: str, err: SGLangHTTPError) -> str:
    hint = _REFUSAL_HINTS.get(err.status, "a client error another attempt would repeat")
    return (f"/generate refused by {url} with HTTP {err.status} (not retried: {hint}); "
            f"answer: {err.body.strip()[:500]}")


def row_sampling_params(row, sampling: SamplingParams, per_row_seed: bool = True) -> dict:
    """One row's SGLang sampling_params (names of srt/sampling/sampling_params.py).

    per_row_seed: add a `sampling_seed` (when sampling.seed is set). SGLang reads it only under
    --enable-deterministic-inference (srt/sampling/sampling_batch_info.py: the seeds tensor is built
    only when enable_deterministic_inference is on); elsewhere it only makes every row its own request."""
    index, _, replica = row
    p = {"temperature": sampling.temperature, "top_p": sampling.top_p,
         "max_new_tokens": sampling.max_new_tokens, "ignore_eos": sampling.ignore_eos}
    if sampling.stop_token_ids:
        p["stop_token_ids"] = sorted(int(t) for t in sampling.stop_token_ids)
    if sampling.top_k != -1:
        p["top_k"] = sampling.top_k
    if sampling.min_p:
        p["min_p"] = sampling.min_p
    if sampling.repetition_penalty != 1.0:
        p["repetition_penalty"] = sampling.repetition_penalty
    if sampling.stop:  # SGLang trims the text only; output_ids keep the stop string's tokens
        p["stop"] = list(sampling.stop)
    # Distinct per row, else the n replicas would be identical. Without deterministic inference rows
    # come from the server's generator (a distinct --random-seed per server: sglang_server.server_seed).
    if per_row_seed and sampling.seed is not None:
        p["sampling_seed"] = (sampling.seed * 1_000_003 + index * 1_009 + replica) % 2**31
    return p


def request_chunks(rows, sampling: SamplingParams, max_rows: int, per_row_seed: bool = True) -> list[list]:
    """Consecutive rows with identical sampling params, at most `max_rows` per request: sglang-router
    parses one sampling_params object per /generate (sgl-model-gateway src/protocols/generate.rs,
    `sampling_params: Option<SamplingParams>`) and answers 422 to a list, so a request never mixes
    params. Per-row seeds make every row its own request; order is kept."""
    chunks: list[list] = []
    last = None
    for row in rows:
        params = row_sampling_params(row, sampling, per_row_seed)
        if chunks and params == last and len(chunks[-1]) < max_rows:
            chunks[-1].append(row)
        else:
            chunks.append([row])
        last = params
    return chunks


def _generate_body(rows, sampling: SamplingParams, per_row_seed: bool = True) -> dict:
    """One /generate body: a batch of input_ids and the single sampling_params they share."""
    return {"input_ids": [prompt for _, prompt, _ in rows],
            "sampling_params": row_sampling_params(rows[0], sampling, per_row_seed),
            "return_logprob": True, "logprob_start_len": -1}


def _as_list(out, num_rows: int) -> list[dict]:
    items = out if isinstance(out, list) else [out]
    if len(items) != num_rows:
        raise _Retryable(f"/generate returned {len(items)} results for {num_rows} inputs")
    return items


def check_server_info(server: Server, cfg: SGLangConfig) -> str:
    """The server's SGLang version from /server_info; RuntimeError for an untested version and for
    settings that differ from `cfg` (a server started elsewhere with other flags)."""
    info = server.client.get("/server_info")
    version = str(info.get("version", "unknown"))
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(f"SGLang {version} at {server.url} is not supported: its weight-update protocol "
                           f"differs from the tested versions {list(SUPPORTED_VERSIONS)}")
    for key in ("kv_cache_dtype", "tp_size"):
        if key in info and str(info[key]) != str(getattr(cfg, key)):
            raise RuntimeError(f"SGLang server {server.url} runs {key}={info[key]!r} but rollout.sglang.{key}="
                               f"{getattr(cfg, key)!r}")
    return version
