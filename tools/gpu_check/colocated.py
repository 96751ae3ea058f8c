"""The colocated protocol's pieces on one GPU, without SGLang.

tcp_spawn           a server-like process started from a torchrun worker (with the project's server
                    environment, rollout/sglang_server.py launch_env) does init_process_group over
                    tcp:// and joins the weight-update group the NCCL transport builds; one broadcast
                    (gloo on CPU in the dry mode: the hang it guards against is not a CUDA one)
ipc_tensor_sync     N syncs of 512 MiB flattened buckets into a second process over CUDA IPC (the
                    tensor transport's payload, rebuilt as SGLang's reconstruct_tensors does, then
                    param.copy_): bytes equal, the consumer's memory flat across syncs, seconds per GB
                    (the dry mode runs the same protocol on CPU tensors in shared memory)
offload_mem_get_info  the trainer's offload seen by a second process's torch.cuda.mem_get_info against
                    the planner's weights + grads + optimizer and offload()'s own count; reload
                    bitwise and the next log-probs identical
cuda_graph_inplace  a replayed CUDA graph sees an in-place parameter update (param.copy_, the engine's
                    update path) and, as expected, not a rebinding (param.data = new)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from common import Check

HERE = os.path.dirname(os.path.abspath(__file__))
PROCS = os.path.join(HERE, "procs.py")
BUCKET_MB, BUCKETS, SYNCS = 512, 4, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_spawn(ctx):
    import torch
    backend = "nccl" if not ctx.dry and torch.cuda.is_available() else "gloo"
    ports = [_free_port() for _ in range(3)]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={ports[0]}",
            PROCS, "worker", "--backend", backend, "--tp-port", str(ports[1]), "--weights-port", str(ports[2]),
            "--timeout", "45"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=100)
    worker = [ln for ln in out.stdout.splitlines() if ln.startswith(("WORKER", "SERVER"))]
    ok = out.returncode == 0 and any(ln.startswith("WORKER OK") for ln in worker)
    detail = {"backend": backend, "lines": worker, "ok": ok}
    if not ok:
        detail["stderr"] = out.stderr[-800:]
    return detail


def _weights(device: str, total_mb: int, seed: int = 0):
    """bf16 and fp8 tensors of total_mb MiB with a float32 scale per 128 x 128 tile, as a blockwise
    FP8 payload holds them."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    rows, cols = 4096, 4096  # 16 MiB of fp8 per weight
    named, size = [], 0
    while size < total_mb * 2**20:
        i = len(named)
        w = torch.randn(rows, cols, generator=gen, device=device).to(torch.float8_e4m3fn)
        named += [(f"layers.{i}.weight", w), (f"layers.{i}.weight_scale_inv", torch.rand(32, 32, device=device))]
        named.append((f"layers.{i}.norm.weight", torch.randn(cols, device=device).to(torch.bfloat16)))
        size += sum(t.numel() * t.element_size() for _, t in named[-3:])
    return named


def _send(proc, bucket, check: bool) -> dict:
    from megatron_rl.rollout.sglang_payload import flatten_bucket, serialize_flattened
    flat, meta = flatten_bucket(bucket)  # a new buffer per bucket (the transport's rule)
    proc.stdin.write(("C " if check else "- ") + serialize_flattened(flat, meta) + "\n")
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    del flat  # the consumer has copied: the IPC block may go
    return reply


def ipc_tensor_sync(ctx):
    """On CPU (the dry mode) the same protocol runs with 8 MiB buckets in shared memory files."""
    import torch
    from procs import checksum

    from megatron_rl.sync.buckets import iter_buckets, tensor_bytes
    cuda = not ctx.dry
    if cuda:
        ctx.need_cuda()
    device, bucket_mb = ("cuda", BUCKET_MB) if cuda else ("cpu", 8)
    named = _weights(device, bucket_mb * BUCKETS)
    buckets = list(iter_buckets(named, bucket_mb * 2**20))
    expected = [sum(checksum(t) for _, t in b) for b in buckets]
    total = sum(tensor_bytes(t) for _, t in named)
    proc = subprocess.Popen([sys.executable, PROCS, "consumer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ))
    try:
        seconds, used, allocated, mismatched = [], [], [], 0
        for n in range(SYNCS):
            check = n in (0, SYNCS - 1)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            replies = [_send(proc, b, check) for b in buckets]
            seconds.append(time.perf_counter() - start)
            if check:
                mismatched += sum(r["checksum"] != e for r, e in zip(replies, expected))
            used.append(replies[-1]["device_used"])
            allocated.append(replies[-1]["allocated"])
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    timed = sorted(seconds[1:-1])  # unchecked syncs only
    s_per_gb = timed[len(timed) // 2] / (total / 1e9)
    growth = max(used[1:]) - min(used[1:])
    detail = {"device": device, "gb_per_sync": round(total / 1e9, 3), "buckets": len(buckets), "syncs": SYNCS,
              "mismatched_buckets": mismatched, "consumer_allocated_gib": [round(a / 2**30, 3) for a in allocated],
              "device_used_growth_mib": round(growth / 2**20, 1), "s_per_gb": round(s_per_gb, 4),
              "ok": mismatched == 0 and len(set(allocated)) == 1 and growth < bucket_mb * 2**20}
    if cuda:
        detail["ratios"] = {"weight_sync_ipc_s_per_gb": s_per_gb}
    return detail


def _ask(proc) -> int:
    proc.stdin.write("?\n")
    proc.stdin.flush()
    return int(proc.stdout.readline())


def offload_mem_get_info(ctx):
    import torch
    from models import actor_of, batch, cfg_of, spec, train
    from procs import checksum

    from megatron_rl.cluster.memory import trainer_memory
    cfg = cfg_of("precision.params_dtype=bf16")
    model = spec(hidden=2048, layers=8, heads=16, kv_heads=8, ffn=5632)
    plan = trainer_memory(cfg, model, dp=1, cuda=True)
    planned = plan["weights"] + plan["grads"] + plan["optimizer"]
    ctx.need_cuda()
    watcher = subprocess.Popen([sys.executable, PROCS, "watcher"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        actor = actor_of(cfg, model)
        b = batch(2, 512)
        train(actor, b, 1)
        before_lp = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False)["logprobs"]
        groups = ("params", "grads", "optimizer")
        sums = {g: [checksum(t) for t in actor._state_tensors(g)] for g in groups}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        used_before = _ask(watcher)
        freed = actor.offload()
        torch.cuda.empty_cache()
        used_after = _ask(watcher)
        reloaded = actor.reload()
        same = all(sums[g] == [checksum(t) for t in actor._state_tensors(g)] for g in groups)
        after_lp = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False)["logprobs"]
    finally:
        watcher.stdin.close()
        watcher.wait(timeout=30)
    seen = used_before - used_after
    return {"seen_by_peer_gib": round(seen / 2**30, 3), "offload_count_gib": round(freed / 2**30, 3),
            "planned_gib": round(planned / 2**30, 3), "seen_over_planned": round(seen / planned, 3),
            "reloaded_equals_freed": reloaded == freed, "state_bitwise": same,
            "logprobs_identical": bool(torch.equal(before_lp, after_lp)),
            "ok": same and reloaded == freed and torch.equal(before_lp, after_lp)
            and abs(seen - freed) <= 0.05 * freed and 0.9 <= seen / planned <= 1.1}


def cuda_graph_inplace(ctx):
    import torch
    ctx.need_cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(512, 512, device="cuda", generator=gen), requires_grad=False)
    x = torch.randn(64, 512, device="cuda", generator=gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            y = x @ weight.T
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x @ weight.T
    new = torch.randn(512, 512, device="cuda", generator=gen)
    with torch.no_grad():
        weight.copy_(new)
    graph.replay()
    copy_seen = bool(torch.allclose(y, x @ new.T, rtol=1e-4, atol=1e-3))
    rebound = torch.randn(512, 512, device="cuda", generator=gen)
    weight.data = rebound
    graph.replay()
    rebind_seen = bool(torch.allclose(y, x @ rebound.T, rtol=1e-4, atol=1e-3))
    return {"copy_seen": copy_seen, "rebind_seen": rebind_seen, "ok": copy_seen and not rebind_seen}


CHECKS = [Check("tcp_spawn", tcp_spawn, 110), Check("ipc_tensor_sync", ipc_tensor_sync, 90),
          Check("offload_mem_get_info", offload_mem_get_info, 60), Check("cuda_graph_inplace", cuda_graph_inplace, 20)]
