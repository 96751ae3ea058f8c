"""Protocol-conformance test server: speaks SGLang's HTTP API on loopback, strictly (test helper).

Not an inference server. Routes, request schemas, auth rules and the unpickler allow-list come from
the installed sglang package (sglang_protocol.py); a request with a field SGLang does not define, a
missing required field, a wrong JSON type, or a pickle global SGLang would refuse gets HTTP 400.
Generation and weight loading are done by the embedded TorchRolloutEngine on a tiny HF model, so
log-probs are real numbers and weight updates really change what is served.

    python sglang_conformance_server.py --model DIR --port P --api-key K [--rollout-quant fp8_blockwise]
        [--die-on-generate-once FILE]   # exit abruptly inside a /generate once (FILE records it)
        [--defer-copies]                # apply update_weights_from_tensor data at the next request, as
                                        # SGLang's asynchronous device copy would
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import pickle
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

import sglang_protocol as proto
from megatron_rl.rollout.base import SamplingParams, tensor_digest
from megatron_rl.rollout.sglang_payload import unflatten_bucket
from megatron_rl.rollout.torch_engine import TorchRolloutEngine

DEADLINE_S = 300.0  # the server stops by itself after this long


class BadRequest(Exception):
    pass


class RestrictedUnpickler(pickle.Unpickler):
    """Accepts exactly the globals SGLang's SafeUnpickler accepts."""

    def find_class(self, module, name):
        if (module, name) not in proto.unpickler_allowed_globals():
            raise BadRequest(f"pickle global {module}.{name} is not allowed by SGLang")
        return super().find_class(module, name)


def validate_body(path: str, body: dict) -> None:
    cls = proto.route_table()[path]["request_class"]
    if cls is None:
        return
    schema = proto.request_schema(cls)
    unknown = sorted(set(body) - set(schema))
    if unknown:
        raise BadRequest(f"{cls}: unknown field(s) {unknown}")
    for name, (annotation, required) in schema.items():
        if name not in body:
            if required:
                raise BadRequest(f"{cls}: missing required field {name!r}")
        elif not proto.check_value(annotation, body[name]):
            raise BadRequest(f"{cls}.{name}: {body[name]!r:.80} does not fit {proto.ast.unparse(annotation)}")


class State:
    def __init__(self, args):
        self.args = args
        self.engine = TorchRolloutEngine(args.model, rollout_quant=args.rollout_quant, seed=0)
        self.weight_version = "0"
        self.pending: int | None = None
        self.deferred: list[tuple[list, int]] = []
        self.paused = False
        self.groups: dict = {}
        self.log: list[str] = []
        self.lock = threading.RLock()

    def apply_deferred(self) -> None:
        for bucket, version in self.deferred:
            self.engine.update_weights([(n, t.clone()) for n, t in bucket], version)
        self.deferred = []

    def load(self, bucket, version_text: str | None) -> None:
        version = int(version_text) if version_text is not None else self.engine.weight_version + 1
        self.apply_deferred()
        if self.args.defer_copies:
            self.deferred.append((bucket, version))
        else:
            self.engine.update_weights([(n, t.clone()) for n, t in bucket], version)
        self.pending = version
        if version_text is not None:
            self.weight_version = version_text

    def settle(self) -> None:
        """What SGLang's flush / continue imply here: every copy done, the version complete."""
        self.apply_deferred()
        if self.pending is not None and self.pending != self.engine.weight_version:
            self.engine.finish_update(self.pending)
        self.pending = None


def handle(state: State, path: str, body: dict):
    s, e = state, state.engine
    if path in ("/health", "/health_generate"):
        return None
    if path == "/model_info":
        return {"model_path": s.args.model, "weight_version": s.weight_version, "is_generation": True}
    if path == "/generate":
        return generate(s, body)
    if path == "/pause_generation":
        s.paused = True
        return {"message": "Generation paused successfully.", "status": "ok"}
    if path == "/continue_generation":
        s.settle()
        s.paused = False
        return {"message": "Generation continued successfully.", "status": "ok"}
    if path == "/flush_cache":
        s.settle()
        return "Cache flushed.\n"
    if path == "/update_weights_from_tensor":
        if body.get("load_format") != "flattened_bucket":
            raise BadRequest("this server takes load_format=flattened_bucket")
        data = RestrictedUnpickler(io.BytesIO(base64.b64decode(body["serialized_named_tensors"][0]))).load()
        s.load(unflatten_bucket(data["flattened_tensor"], data["metadata"]), body.get("weight_version"))
        return {"success": True, "message": "Success"}
    if path == "/init_weights_update_group":
        return init_group(s, body)
    if path == "/destroy_weights_update_group":
        torch.distributed.destroy_process_group(s.groups.pop(body.get("group_name", "weight_update_group")))
        return {"success": True, "message": "destroyed"}
    if path == "/update_weights_from_distributed":
        return receive_distributed(s, body)
    if path == "/update_weights_from_disk":
        return load_from_disk(s, body)
    if path == "/release_memory_occupation":
        e.release_memory(tuple(body["tags"]) if body.get("tags") else None)
        return None
    if path == "/resume_memory_occupation":
        e.resume_memory(tuple(body["tags"]) if body.get("tags") else None)
        return None
    if path == "/weights_checker":
        return check_weights(s, body)
    raise BadRequest(f"{path} is an SGLang route this conformance server does not serve")


def generate(s: State, body: dict):
    ids = body["input_ids"]
    batch = bool(ids) and isinstance(ids[0], list)
    rows = ids if batch else [ids]
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(rows)
    for p in params:
        unknown = set(p) - proto.sampling_param_names()
        if unknown:
            raise BadRequest(f"SamplingParams: unknown field(s) {sorted(unknown)}")
    if s.args.die_on_generate_once and not Path(s.args.die_on_generate_once).exists():
        Path(s.args.die_on_generate_once).write_text("died")
        os._exit(1)  # a crash in the middle of a request: the client sees the connection drop
    out = [one_row(s, row, p, body) for row, p in zip(rows, params)]
    return out if batch else out[0]


def one_row(s: State, prompt: list[int], p: dict, body: dict) -> dict:
    if s.paused:
        return {"text": "", "output_ids": [], "meta_info": {
            "id": "r", "finish_reason": {"type": "abort", "message": "paused"}, "weight_version": s.weight_version}}
    sp = SamplingParams(temperature=p.get("temperature", 1.0), top_p=p.get("top_p", 1.0),
                        max_new_tokens=p.get("max_new_tokens", 128), stop_token_ids=tuple(p.get("stop_token_ids") or ()),
                        ignore_eos=p.get("ignore_eos", False), seed=p.get("sampling_seed"))
    with s.lock:
        sample = s.engine.generate([prompt], sp)[0]
    reason = ({"type": "stop", "matched": sample.response_ids[-1]} if sample.finish_reason == "stop"
              else {"type": "length", "length": len(sample.response_ids)})
    meta = {"id": "r", "finish_reason": reason, "prompt_tokens": len(prompt), "weight_version": s.weight_version,
            "completion_tokens": len(sample.response_ids)}
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(sample.rollout_logprobs, sample.response_ids)]
    return {"text": "", "output_ids": sample.response_ids, "meta_info": meta}


def init_group(s: State, body: dict):
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    import datetime

    timeout = datetime.timedelta(seconds=60)
    rank = body["rank_offset"]  # + tp rank (always 0 here)
    store, rank, world = next(rendezvous(f"tcp://{body['master_address']}:{body['master_port']}", rank,
                                         body["world_size"], timeout=timeout))
    name = body.get("group_name", "weight_update_group")
    group, _ = _new_process_group_helper(world, rank, [], Backend(body.get("backend", "nccl")), PrefixStore(name, store),
                                         group_name=name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    s.groups[name] = group
    return {"success": True, "message": "Succeeded to initialize custom process group."}


def receive_distributed(s: State, body: dict):
    group = s.groups.get(body.get("group_name", "weight_update_group"))
    if group is None:
        raise BadRequest("init_weights_update_group first")
    metadata, offset = [], 0
    for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
        dt = getattr(torch, dtype)
        if offset % dt.itemsize:  # what FlattenedTensorBucket.empty refuses
            raise BadRequest(f"unaligned tensor {name}: byte offset {offset}, dtype {dtype}")
        size = torch.Size(shape).numel() * dt.itemsize
        metadata.append(argparse.Namespace(name=name, shape=torch.Size(shape), dtype=dt, start_idx=offset,
                                           end_idx=offset + size, numel=size))
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8)
    torch.distributed.broadcast(flat, src=0, group=group)
    s.load(unflatten_bucket(flat, metadata), body.get("weight_version"))
    return {"success": True, "message": "Succeeded to update parameter online."}


def load_from_disk(s: State, body: dict):
    from safetensors.torch import load_file

    folder = Path(body["model_path"])
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):
        s.load(list(load_file(str(folder / shard)).items()), body.get("weight_version"))
    s.settle()
    return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


def check_weights(s: State, body: dict):
    if body.get("action", "checksum") != "checksum":
        raise BadRequest("this server implements action=checksum only")
    s.settle()
    sums = s.engine.checksum()
    overall = hashlib.sha256("".join(f"{n}{sums[n]}" for n in sorted(sums)).encode()).hexdigest()
    info = {"checksums": sums, "per_gpu_checksum": overall, "parallelism_info": []}
    return {"success": True, "message": "", "ranks": [info],
            "per_engine_checksum": hashlib.sha256(overall.encode()).hexdigest()}


def make_handler(state: State):
    auth = proto.auth_module()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def _serve(self, method: str):
            path = self.path.split("?")[0]
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if path == "/_conformance/log":
                return self._reply(200, state.log)
            route = proto.route_table().get(path)
            if route is None or method not in route["methods"]:
                return self._reply(404, {"error": f"no route {method} {path}"})
            decision = auth.decide_request_auth(
                method=method, path=path, authorization_header=self.headers.get("Authorization"),
                api_key=state.args.api_key, admin_api_key=None, auth_level=auth.AuthLevel(route["auth_level"]))
            if not decision.allowed:
                return self._reply(decision.error_status_code, {"error": "Unauthorized"})
            try:
                validate_body(path, body)
                with state.lock:
                    state.log.append(path)
                self._reply(200, handle(state, path, body))
            except (BadRequest, KeyError, ValueError, RuntimeError) as err:
                self._reply(400, {"error": f"{type(err).__name__}: {err}"})

        def _reply(self, status: int, payload):
            raw = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--rollout-quant", default="bf16")
    ap.add_argument("--die-on-generate-once", default="")
    ap.add_argument("--defer-copies", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(State(args)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(DEADLINE_S)
    sys.exit(0)


if __name__ == "__main__":
    main()
