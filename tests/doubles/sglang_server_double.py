"""A behavioural double of an SGLang 0.5.23 server: real HTTP on loopback, real tokens (tests only).

Launch it the way the project launches `python -m sglang.launch_server` (same flags; GPU-only flags
such as --mem-fraction-static, --base-gpu-id, --enable-memory-saver are accepted and ignored)::

    python tests/doubles/sglang_server_double.py --model-path DIR --host 127.0.0.1 --port 30000 \
        --api-key KEY [--tp-size N] [--weight-version 0] [--random-seed S] [--kv-cache-dtype fp8_e4m3]
        [--enable-deterministic-inference] [--health-generate-s 0.3]   # double-only knobs below
        [--die-on-generate-once FILE]  # exit inside the first /generate (FILE records it)
        [--report-version 0.5.5]       # what /server_info reports (to test version checks)
        [--defer-copies]               # apply update_weights_from_tensor data at the next request, as
                                       # SGLang's asynchronous device copy may (the buffer is read late)
        [--lifetime-s 600]             # the process exits by itself after this long

or point `rollout.sglang.server_command` at `[python, tests/doubles/sglang_server_double.py]`.
It needs torch, transformers and this repository (found from the file's location).

Generation runs the embedded TorchRolloutEngine on the weights the server holds (SGLang's fused
layout, tests/doubles/sglang_weights_double.py), re-split into HF names; a block-FP8 checkpoint is
served with W8A8 emulation at its own block size. Behaviours and where they come from (paths under
sglang/srt/, version 0.5.23):

- Auth: with --api-key every route needs `Authorization: Bearer KEY` except paths starting with
  /health, /ready, /metrics (utils/auth.py:98-106; ADMIN_OPTIONAL routes also need it once a key is
  set). Wrong or missing key: 401.
- /server_info carries "version" (entrypoints/http_server.py:863-893); /model_info "weight_version".
- Update session: update_weights_from_tensor / _from_distributed outside begin_weight_update ..
  end_weight_update answer success=False, HTTP 400, "must run between begin_weight_update() and
  end_weight_update()" (managers/scheduler_components/weight_updater.py:187-240); a second begin or
  an end without begin fails too (weight_updater.py:309-334).
- update_weights_from_tensor: TP rank r deserializes serialized_named_tensors[r] only
  (managers/tp_worker.py:194-201); a payload shared by two ranks would be opened twice, which breaks
  the producer's CUDA-IPC refcounting: refused here. A list shorter than tp_size fails (IndexError).
- weight_version: every update carrying one sets it (tokenizer_control_mixin.py:525-527); every
  /generate answer's meta_info carries it (tokenizer_manager.py:2511).
- pause_generation: new /generate requests wait until continue_generation
  (tokenizer_manager.py:938-939, 2267-2286); mode "abort" ends requests in flight with
  finish_reason {"type": "abort", "message": "Aborted"} and waits until none runs; "retract" and
  "in_place" keep them and they answer after continue_generation, reporting the weight version
  current then (checked against the real server: tests/sglang_real/test_real_conformance.py).
- flush_cache: 400 "Flush cache failed." while any request runs, waits or is held by an in_place
  pause (a retracted one does not count), health-generation probes included
  (scheduler.py:5518-5547, http_server.py:1025-1040); /health_generate holds a 1-token request for
  --health-generate-s seconds (http_server.py:721-790), so a probe can collide with a flush.
- release/resume_memory_occupation with tags (weights, kv_cache, cuda_graph; none = all). A release
  while a request is inside, or a resume of a tag that is not released, raises in SGLang's scheduler
  (weight_updater.py:337-391: an assert, offload_tags.remove), and a scheduler exception ends the
  whole server (scheduler.py:6370-6379): the double exits without answering. Released weights are
  discarded (torch_memory_saver without CPU backup): after resume they hold garbage (zeros here)
  until the next update. /generate while weights or the KV
  cache are released would touch unmapped memory in SGLang; here it is refused with 400. A resume
  restores only the tags it names (weight_updater.py:383-420); with SGLANG_MEMORY_SAVER_CUDA_GRAPH
  set (and graphs on) the graphs live in the "cuda_graph" region (runner_backend/
  cuda_graph_dedup_mixin.py:298-337), and /generate while it is released answers 500 (an illegal
  memory access in SGLang).
- FP8 KV cache (--kv-cache-dtype fp8*): per-layer k_scale / v_scale in weight memory, discarded by a
  weights release, renamed from `self_attn.k_scale` on load, re-derived at every update's end
  (KvScales in sglang_server_state.py, kv_cache.py:32-82); GET /_double/kv_scales shows them.
- load_weights with SGLang's name mapping per architecture (see sglang_weights_double.py).
- ignore_eos turns off stop_token_ids too (managers/schedule_batch.py `_check_token_based_finish`).
- sampling_seed is honoured only with --enable-deterministic-inference
  (sampling/sampling_batch_info.py:157-171); otherwise the server's own generator (--random-seed).
- /flush_cache answers text/plain; weight-update endpoints {"success", "message"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parents[1])]

import torch  # noqa: E402

import sglang_weights_double as weights  # noqa: E402
from double_http import QuietHandler, serve  # noqa: E402
from sglang_server_state import BadRequest, ServerState  # noqa: E402

SGLANG_VERSION = "0.5.23"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--api-key", default="")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--enable-memory-saver", action="store_true")
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    ap.add_argument("--health-generate-s", type=float, default=0.0)
    ap.add_argument("--die-on-generate-once", default="")
    ap.add_argument("--defer-copies", action="store_true")
    ap.add_argument("--report-version", default=SGLANG_VERSION)
    ap.add_argument("--lifetime-s", type=float, default=600.0)
    args, ignored = ap.parse_known_args(argv)
    args.ignored = ignored  # GPU-only flags (--mem-fraction-static, --base-gpu-id, ...)
    return args


def authorized(path: str, header: str | None, api_key: str) -> bool:
    if not api_key or path.startswith(OPEN_PREFIXES):
        return True
    parts = (header or "").split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and parts[1] == api_key


def make_handler(state: ServerState):
    class Handler(QuietHandler):
        def do_GET(self):
            self._serve()

        def do_POST(self):
            self._serve()

        def _serve(self):
            path = self.path.split("?")[0]
            raw = self.body()
            if not authorized(path, self.headers.get("Authorization"), state.args.api_key):
                return self.reply(401, {"error": "Unauthorized"})
            try:
                status, payload = state.handle(path, json.loads(raw or b"{}"))
            except BadRequest as err:
                status, payload = 400, {"error": str(err)}
            except weights.LoadError as err:
                status, payload = 400, {"success": False, "message": str(err)}
            self.reply(status, payload)

    return Handler


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    state = ServerState(args, args.report_version)
    serve(make_handler(state), args.host, args.port, args.lifetime_s,
          f"sglang double {args.report_version} serving {args.model_path} on {args.host}:{args.port}")

if __name__ == "__main__":
    main()
