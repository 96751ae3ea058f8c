"""State and routes of the SGLang server double (see sglang_server_double.py for the sources)."""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import json
import os
import pickle
import threading
import time
import types
from pathlib import Path

import torch

import sglang_protocol
import sglang_weights_double as weights
from megatron_rl.rollout.base import SamplingParams, tensor_digest
from megatron_rl.rollout.sglang_payload import unflatten_bucket
from megatron_rl.rollout.torch_engine import TorchRolloutEngine

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # srt/constants.py GPU_MEMORY_ALL_TYPES
SESSION_RULE = "must run between begin_weight_update() and end_weight_update()"
SAFE_MODULES = ("torch", "torch._utils", "torch.storage", "torch.multiprocessing.reductions", "types")


class BadRequest(Exception):
    pass


class _Unpickler(pickle.Unpickler):
    """SGLang's SafeUnpickler allow-list (utils/common.py), read from the installed sglang source when
    it is there, else torch rebuild functions, dtypes, Size and SimpleNamespace."""

    def find_class(self, module, name):
        allowed = _allowed_globals()
        ok = (module, name) in allowed if allowed else module in SAFE_MODULES
        if not ok:
            raise BadRequest(f"pickle global {module}.{name} is not allowed by SGLang's SafeUnpickler")
        return super().find_class(module, name)


def _allowed_globals() -> frozenset:
    return sglang_protocol.unpickler_allowed_globals() if sglang_protocol.sglang_root() else frozenset()


def _ok(message: str = "Success"):
    return 200, {"success": True, "message": message}


def _fail(message: str):
    return 400, {"success": False, "message": message}


class ServerState:
    def __init__(self, args, version: str):
        self.args, self.version = args, version
        self.config = weights.read_config(args.model_path)
        self.arch = weights.ARCHS[self.config["architectures"][0]]
        self.dtype = weights.serving_dtype(self.config, args.dtype)
        self.params = weights.build_params(_read_checkpoint(args.model_path), self.config, self.dtype)
        weights.load_weights(self.arch, self.params, _read_checkpoint(args.model_path).items())
        self.engine = _make_engine(self.config, args.random_seed)
        self.engine.stop_tokenizer_source = args.model_path  # SGLang's tokenizer for stop strings
        self.engine_version = 0
        self.dirty = True
        self.weight_version = args.weight_version
        self.session: dict | None = None
        self.paused, self.abort_epoch, self.in_flight = False, 0, 0
        self.pause_mode, self.retracted = "abort", 0
        self.kv = KvScales(self.config["num_hidden_layers"]) if args.kv_cache_dtype.startswith("fp8") else None
        self.released: set[str] = set()
        # CUDA graphs live in torch_memory_saver's "cuda_graph" region only when the server starts
        # with SGLANG_MEMORY_SAVER_CUDA_GRAPH set and graphs on (runner_backend/
        # cuda_graph_dedup_mixin.py:298-337, full_cuda_graph_backend.py:123-191); releasing that tag
        # then unmaps the graphs' memory, which a decode replay touches until it is resumed.
        self.graphs_in_saver = (os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "").lower() in ("1", "true")
                                and "--disable-cuda-graph" not in args.ignored)
        self.groups: dict = {}
        self.cond = threading.Condition()
        self.gen_lock = threading.Lock()
        self.log: list[str] = []
        self.generate_rows: list[int] = []  # rows (input_ids entries) of each /generate, in arrival order
        # SGLANG_DOUBLE_RECORD=<folder>: one JSON line per request into <folder>/<host>_<port>.jsonl with the
        # server's state as the request arrives (paused, weight version, update session open,
        # released memory tags), so a test can assert what the client did when.
        record = os.environ.get("SGLANG_DOUBLE_RECORD", "")
        self.record_file = Path(record) / f"{args.host}_{args.port}.jsonl" if record else None
        self.deferred: list = []

    # ---- routing -------------------------------------------------------------------------

    def handle(self, path: str, body: dict):
        with self.cond:
            self.log.append(path)
            self._record(path)
        self._apply_deferred()
        route = ROUTES.get(path)
        if route is None:
            return 404, {"error": f"no route {path}"}
        validate_body(path, body)
        return route(self, body)

    def _record(self, path: str) -> None:
        if self.record_file is None:
            return
        line = {"path": path, "paused": self.paused, "weight_version": self.weight_version,
                "update_session": self.session is not None, "released": sorted(self.released), "t": time.time()}
        with open(self.record_file, "a") as f:
            f.write(json.dumps(line) + "\n")

    def health(self, body):
        return 200, ""

    def health_generate(self, body):
        with self.cond:
            self.in_flight += 1
        try:
            time.sleep(self.args.health_generate_s)
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()
        return 200, ""

    def server_info(self, body):
        a = self.args
        return 200, {"version": self.version, "model_path": a.model_path, "tp_size": a.tp_size,
                     "dtype": str(self.dtype).removeprefix("torch."),
                     "kv_cache_dtype": a.kv_cache_dtype, "quantization": a.quantization,
                     "enable_memory_saver": a.enable_memory_saver, "random_seed": a.random_seed,
                     "enable_deterministic_inference": a.enable_deterministic_inference,
                     "launch_command": " ".join(a.ignored)}

    def model_info(self, body):
        return 200, {"model_path": self.args.model_path, "weight_version": self.weight_version,
                     "is_generation": True, "architectures": self.config["architectures"]}

    # ---- generation ----------------------------------------------------------------------

    def generate(self, body):
        if self.released & {"weights", "kv_cache"}:
            raise BadRequest(f"memory released ({sorted(self.released)}): resume_memory_occupation first")
        if "cuda_graph" in self.released and self.graphs_in_saver:
            return 500, {"error": "CUDA error: an illegal memory access was encountered (CUDA graph "
                                  "replayed on released memory: resume tags=['cuda_graph'] first)"}
        with self.cond:
            self.cond.wait_for(lambda: not self.paused)
            self.in_flight += 1
            epoch = self.abort_epoch
        try:
            self._maybe_die()
            out = self._generate_rows(body, epoch)
            with self.cond:  # a request kept by a retract / in_place pause answers after continue
                self.cond.wait_for(lambda: not self.paused or self.abort_epoch != epoch)
                for item in out if isinstance(out, list) else [out]:  # the version when it finished
                    item["meta_info"]["weight_version"] = self.weight_version
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()
        return 200, out

    def _maybe_die(self):
        """Once per marker file across every server sharing it: the exclusive create is atomic, so
        two servers whose first /generate arrives at the same moment cannot both die."""
        marker = self.args.die_on_generate_once
        if not marker:
            return
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, b"died")
        os.close(fd)
        os._exit(1)  # mid-request crash: the client sees the connection drop

    def _generate_rows(self, body, epoch):
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        rows = ids if batch else [ids]
        with self.cond:
            self.generate_rows.append(len(rows))
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(rows)
        with self.gen_lock:
            self._refresh_engine()
            out = [self._one_row(r, p, body) for r, p in zip(rows, params)]
        if self.abort_epoch != epoch:  # pause(mode=abort) arrived while this request ran
            out = [_aborted(self.weight_version) for _ in rows]
        return out if batch else out[0]

    def _one_row(self, prompt, p, body):
        seed = p.get("sampling_seed") if self.args.enable_deterministic_inference else None
        # ignore_eos turns off every token-based stop, stop_token_ids included
        # (managers/schedule_batch.py `_check_token_based_finish` returns early)
        stop_ids = () if p.get("ignore_eos", False) else tuple(p.get("stop_token_ids") or ())
        sp = SamplingParams(temperature=p.get("temperature", 1.0), top_p=p.get("top_p", 1.0),
                            max_new_tokens=p.get("max_new_tokens", 128), stop_token_ids=stop_ids,
                            ignore_eos=p.get("ignore_eos", False), seed=seed,
                            top_k=p.get("top_k", -1), min_p=p.get("min_p", 0.0), stop=tuple(p.get("stop") or ()))
        s = self.engine.generate([prompt], sp)[0]
        reason = ({"type": "stop", "matched": s.response_ids[-1]} if s.finish_reason == "stop"
                  else {"type": "length", "length": len(s.response_ids)})
        meta = {"id": "r", "finish_reason": reason, "prompt_tokens": len(prompt),
                "completion_tokens": len(s.response_ids), "weight_version": self.weight_version}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.rollout_logprobs, s.response_ids)]
        return {"text": "", "output_ids": s.response_ids, "meta_info": meta}

    def _refresh_engine(self):
        """Hand the held (fused) weights to the embedded engine, split into HF names."""
        if not self.dirty:
            return
        self.engine_version += 1
        self.engine.update_weights([(n, t.clone()) for n, t in weights.to_hf(self.params)], self.engine_version)
        self.engine.finish_update(self.engine_version)
        self.dirty = False

    # ---- pause / flush / memory ----------------------------------------------------------

    def pause_generation(self, body):
        """abort ends the requests inside (finish_reason abort, message "Aborted":
        managers/schedule_batch.py:335); retract and in_place keep them, and they answer only after
        continue_generation (their tokens here all come from the weights they started on: generation
        is one step in the double). retract frees their KV cache, so a flush may run meanwhile;
        in_place holds it, so /flush_cache is refused until they finish."""
        with self.cond:
            self.paused = True
            self.pause_mode = body.get("mode", "abort")
            if self.pause_mode == "abort":
                self.abort_epoch += 1
                self.cond.wait_for(lambda: self.in_flight == 0, timeout=60)
            elif self.pause_mode == "retract":
                self.retracted = self.in_flight
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body):
        with self.cond:
            self.paused = False
            self.retracted = 0
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def flush_cache(self, body):
        """Refused while a request runs, waits, or is held by an in_place pause; a request retracted by a
        retract pause does not count (entrypoints/http_server.py:1025-1040 writes these bodies; the
        scheduler's flush_cache checks is_fully_idle, scheduler.py:5518-5547)."""
        with self.cond:
            if self.in_flight - self.retracted:
                return 400, "Flush cache failed.\n"
        return 200, ("Cache flushed.\nPlease check backend logs for more details. "
                     "(When there are running or waiting requests, the operation will not be performed.)\n")

    def release_memory_occupation(self, body):
        tags = body.get("tags") or list(MEMORY_TAGS)
        with self.cond:
            if self.in_flight:
                _scheduler_dies("AssertionError: release_memory_occupation should be called only when server is idle.")
            self.released |= set(tags)
        if "weights" in tags:
            for p in self.params.values():
                p.data.zero_()  # discarded: what the GPU pages hold after resume is not the weights
            if self.kv is not None:
                self.kv.discard()
            self.dirty = True
        return 200, None

    def resume_memory_occupation(self, body):
        tags = body.get("tags") or list(MEMORY_TAGS)
        missing = set(tags) - self.released
        if missing:  # offload_tags.remove (weight_updater.py:383-391)
            _scheduler_dies(f"KeyError: {sorted(missing)[0]!r}")
        self.released -= set(tags)
        return 200, None

    # ---- weight updates ------------------------------------------------------------------

    def begin_weight_update(self, body):
        if self.session is not None:
            return _fail("a weight-update session is already open; call end_weight_update() first")
        self.session = {"loaded": False}
        return _ok()

    def end_weight_update(self, body):
        if self.session is None:
            return _fail("no weight-update session is open; call begin_weight_update() first")
        self.session = None
        if self.kv is not None:
            self.kv.postprocess()
        return _ok()

    def update_weights_from_tensor(self, body):
        if self.session is None:
            return _fail(f"update_weights_from_tensor {SESSION_RULE}")
        if "weights" in self.released:
            return _fail("weights are released: resume_memory_occupation(tags=['weights']) first")
        payloads = body["serialized_named_tensors"]
        if len(payloads) < self.args.tp_size:
            return _fail(f"IndexError: {len(payloads)} payloads for tp_size {self.args.tp_size}")
        if len(set(payloads[:self.args.tp_size])) < self.args.tp_size:
            return _fail("one payload shared by several TP ranks: each rank opens only its own (tp_worker.py:194)")
        if body.get("load_format") != "flattened_bucket":
            raise BadRequest("the double takes load_format=flattened_bucket")
        for rank in range(self.args.tp_size):
            data = _Unpickler(io.BytesIO(base64.b64decode(payloads[rank]))).load()
            bucket = unflatten_bucket(data["flattened_tensor"], data["metadata"])
        if self.args.defer_copies:  # the answer comes before the device copy (views of the sender's memory)
            self.deferred.append(bucket)
            bucket = []
        return self._load(bucket, body)  # every rank holds the same (unsharded, here) weights

    def _scales_out(self, bucket):
        """k_scale / v_scale go to the attention layers' scale memory, the rest to load_weights."""
        if self.kv is None:
            return bucket
        return [(n, t) for n, t in bucket if not self.kv.load(n, t)]

    def double_kv_scales(self, body):
        """Test introspection: the (k, v) scale floats attention uses, per layer."""
        return 200, self.kv.effective if self.kv is not None else []

    def _apply_deferred(self):
        with self.cond:
            pending, self.deferred = self.deferred, []
        for bucket in pending:
            weights.load_weights(self.arch, self.params, self._scales_out(bucket))
            self.dirty = True

    def _load(self, bucket, body):
        weights.load_weights(self.arch, self.params, self._scales_out(bucket))
        self.dirty = True
        self.session["loaded"] = True
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        if body.get("flush_cache", True) and self.in_flight:
            return _fail("Weights were updated, but the cache was not flushed because requests are still running")
        # the scheduler's message (tensor "Success", distributed "Succeeded to update parameter online.",
        # scheduler_components/weight_updater.py:213-244) plus tokenizer_control_mixin.py:529-531's suffix
        message = "Success" if "serialized_named_tensors" in body else "Succeeded to update parameter online."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return _ok(message)

    def update_weight_version(self, body):
        self.weight_version = body["new_version"]
        return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                     "new_version": body["new_version"]}

    def init_weights_update_group(self, body):
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                        _world, rendezvous)

        timeout = datetime.timedelta(seconds=120)
        name = body.get("group_name", "weight_update_group")
        store, rank, world = next(rendezvous(f"tcp://{body['master_address']}:{body['master_port']}",
                                             body["rank_offset"], body["world_size"], timeout=timeout))
        backend = body.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # the double has no GPU: the trainer side must then use gloo too
        group, _ = _new_process_group_helper(world, rank, [], Backend(backend), PrefixStore(name, store),
                                             group_name=name, backend_options=None, timeout=timeout)
        _world.pg_group_ranks[group] = {i: i for i in range(world)}
        self.groups[name] = group
        return _ok("Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, body):
        torch.distributed.destroy_process_group(self.groups.pop(body.get("group_name", "weight_update_group")))
        return _ok("Succeeded to destroy custom process group.")

    def update_weights_from_distributed(self, body):
        if self.session is None:
            return _fail(f"update_weights_from_distributed {SESSION_RULE}")
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return _fail("Failed to receive weights: no such group")
        meta, offset = [], 0
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            dt = getattr(torch, dtype)
            if offset % dt.itemsize:  # FlattenedTensorBucket.empty refuses it
                return _fail(f"Failed to receive weights: unaligned tensor {name} at byte {offset}")
            size = torch.Size(shape).numel() * dt.itemsize
            meta.append(types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dt,
                                              start_idx=offset, end_idx=offset + size, numel=size))
            offset += size
        flat = torch.empty(offset, dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=group)
        return self._load(unflatten_bucket(flat, meta), body)

    def update_weights_from_disk(self, body):
        folder = body["model_path"]
        weights.load_weights(self.arch, self.params, self._scales_out(list(_read_checkpoint(folder).items())))
        if self.kv is not None:
            self.kv.postprocess()  # load_weights_and_postprocess, as at the end of a session
        self.dirty = True
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def weights_checker(self, body):
        if body.get("action", "checksum") != "checksum":
            raise BadRequest("the double implements action=checksum only")
        sums = {n: _digest(p.data) for n, p in sorted(self.params.items())}
        overall = hashlib.sha256("".join(f"{n}{s}" for n, s in sums.items()).encode()).hexdigest()
        info = {"checksums": sums, "per_gpu_checksum": overall, "parallelism_info": []}
        return 200, {"success": True, "message": "", "ranks": [info] * self.args.tp_size,
                     "per_engine_checksum": hashlib.sha256(overall.encode()).hexdigest()}

    def double_log(self, body):
        return 200, list(self.log)

    def double_generate_rows(self, body):
        """Test introspection: how many rows each /generate request carried."""
        return 200, list(self.generate_rows)

    def double_hf_digests(self, body):
        """Test introspection: digests of the held weights split back into HF names."""
        return 200, {n: tensor_digest(t) for n, t in weights.to_hf(self.params)}


ROUTES = {"/health": ServerState.health, "/health_generate": ServerState.health_generate,
          "/ready": ServerState.health, "/server_info": ServerState.server_info,
          "/get_server_info": ServerState.server_info, "/model_info": ServerState.model_info,
          "/generate": ServerState.generate, "/pause_generation": ServerState.pause_generation,
          "/continue_generation": ServerState.continue_generation, "/flush_cache": ServerState.flush_cache,
          "/release_memory_occupation": ServerState.release_memory_occupation,
          "/resume_memory_occupation": ServerState.resume_memory_occupation,
          "/begin_weight_update": ServerState.begin_weight_update,
          "/end_weight_update": ServerState.end_weight_update,
          "/update_weights_from_tensor": ServerState.update_weights_from_tensor,
          "/update_weights_from_distributed": ServerState.update_weights_from_distributed,
          "/update_weights_from_disk": ServerState.update_weights_from_disk,
          "/update_weight_version": ServerState.update_weight_version,
          "/init_weights_update_group": ServerState.init_weights_update_group,
          "/destroy_weights_update_group": ServerState.destroy_weights_update_group,
          "/weights_checker": ServerState.weights_checker, "/_double/log": ServerState.double_log,
          "/_double/generate_rows": ServerState.double_generate_rows,
          "/_double/hf_digests": ServerState.double_hf_digests, "/_double/kv_scales": ServerState.double_kv_scales}


def validate_body(path: str, body: dict) -> None:
    """FastAPI/msgspec's check of the request class (srt/managers/io_struct.py), read from the installed
    sglang source when it is there: unknown fields, missing required ones, wrong JSON types -> 400."""
    if sglang_protocol.sglang_root() is None or path not in sglang_protocol.route_table():
        return
    cls = sglang_protocol.route_table()[path]["request_class"]
    if cls is None:
        return
    schema = sglang_protocol.request_schema(cls)
    unknown = sorted(set(body) - set(schema))
    if unknown:
        raise BadRequest(f"{cls}: unknown field(s) {unknown}")
    for name, (annotation, required) in schema.items():
        if name not in body:
            if required:
                raise BadRequest(f"{cls}: missing required field {name!r}")
        elif not sglang_protocol.check_value(annotation, body[name]):
            raise BadRequest(f"{cls}.{name}: {body[name]!r:.80} does not fit {sglang_protocol.ast.unparse(annotation)}")
    if path == "/generate":
        params = body.get("sampling_params") or {}
        for p in params if isinstance(params, list) else [params]:
            extra = set(p) - sglang_protocol.sampling_param_names()
            if extra:
                raise BadRequest(f"SamplingParams: unknown field(s) {sorted(extra)}")


def _scheduler_dies(error: str) -> None:
    """An exception in SGLang's scheduler event loop ends the whole server: run_scheduler_process
    (managers/scheduler.py:6370-6379) logs it and SIGQUITs the parent, which kills its process tree;
    the request gets no answer (the connection closes)."""
    print(f"Scheduler hit an exception: {error}", flush=True)
    os._exit(1)


def _aborted(version: str) -> dict:
    return {"text": "", "output_ids": [], "meta_info": {
        "id": "r", "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
        "weight_version": version}}


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _read_checkpoint(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _make_engine(config: dict, seed: int) -> TorchRolloutEngine:
    """The embedded engine on the checkpoint's architecture (weights arrive from the held params)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    hf_config = AutoConfig.for_model(plain.pop("model_type"), **plain)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    block = weights.block_size_of(config)
    if block is None:
        return TorchRolloutEngine(model, seed=seed)
    qc = config["quantization_config"]
    high = tuple(qc.get("modules_to_not_convert") or ()) + ("embed_tokens", "lm_head", "norm")
    return TorchRolloutEngine(model, rollout_quant="fp8_blockwise", weight_block_size=block, seed=seed,
                              scale_format="ue8m0" if qc.get("scale_fmt") == "ue8m0" else "fp32",
                              high_precision=high)


# What torch_memory_saver's released pages hold after a resume without a CPU backup: anything. A
# positive value, so SGLang's re-derivation below keeps it (zeros would fall back to 1.0).
DISCARDED_SCALE = 0.0137


class KvScales:
    """An FP8 KV cache's per-layer k_scale / v_scale (SGLang 0.5.23):
    - parameters of each RadixAttention, in weight memory, created at -1.0
      (layers/quantization/kv_cache.py:32-46): a weights release discards them with the weights;
    - an incoming `....k_scale` / `.v_scale` is renamed to `.attn.k_scale` (model_loader/
      weight_utils.py:1816-1844, maybe_remap_kv_scale_name) and loaded into them;
    - at the end of every update DefaultModelLoader.postprocess_weights runs the quant method's
      process_weights_after_loading (model_runner_components/weight_updater.py:317-322), which
      re-derives the floats attention uses from that memory: both > 0 -> as held, both <= 0 -> 1.0,
      else the larger of the two for both (kv_cache.py:51-82)."""

    def __init__(self, num_layers: int):
        self.held = [[-1.0, -1.0] for _ in range(num_layers)]
        self.postprocess()

    def load(self, name: str, tensor) -> bool:
        leaf = name.rpartition(".")[2]
        if leaf not in ("k_scale", "v_scale") or ".layers." not in name:
            return False
        layer = int(name.split(".layers.")[1].split(".")[0])
        self.held[layer][leaf == "v_scale"] = float(tensor)
        return True

    def discard(self) -> None:
        self.held = [[DISCARDED_SCALE, DISCARDED_SCALE] for _ in self.held]

    def postprocess(self) -> None:
        out = []
        for k, v in self.held:
            if k > 0 and v > 0:
                out.append([k, v])
            elif k <= 0 and v <= 0:
                out.append([1.0, 1.0])
            else:
                out.append([max(k, v)] * 2)
        self.effective = out

