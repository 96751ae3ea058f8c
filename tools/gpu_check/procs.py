"""The other processes of tools/gpu_check's colocated checks (run as `python procs.py MODE ...`).

worker    a torchrun worker: its own default group (env://), then it starts a server-like process
          with the environment the project gives its SGLang servers (rollout/sglang_server.py
          launch_env) and meets it in a weight-update group built as the NCCL transport builds it
          (collectives.rendezvous_group_as_rank0); prints `WORKER OK <sum>` after one broadcast
server    what an SGLang server does at start and at /init_weights_update_group: init_process_group
          over tcp:// for its own TP group (nccl on CUDA: one all_reduce), then joins the weight group
          (gloo: both ends on one GPU) as rank 1 and receives
consumer  a colocated engine's side of the IPC tensor sync: reads base64 payloads (one a line),
          rebuilds the tensors as SGLang's FlattenedTensorBucket.reconstruct_tensors does (views of
          the flat buffer), param.copy_ into its own preallocated parameters, answers one JSON line
          (checksum, its allocated bytes, the device's used bytes)
watcher   answers each stdin line with the device's used bytes from torch.cuda.mem_get_info (what a
          second process, e.g. an SGLang server sizing its KV pool, sees)
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

WEIGHT_GROUP = "gpu_check_weights"


def checksum(t: torch.Tensor) -> int:
    """Position-weighted sum of the bytes (swapped or shifted bytes change it), in 64 MiB pieces."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    total, piece = 0, 1 << 26
    for start in range(0, raw.numel(), piece):
        part = raw[start:start + piece].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), device=raw.device, dtype=torch.int64) % 251 + 1
        total += int((part * weight).sum())
    return total


def _device(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def worker(args) -> int:
    from megatron_rl.collectives import rendezvous_group_as_rank0
    from megatron_rl.rollout.sglang_server import launch_env
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(args.backend, timeout=timeout)  # the trainer's own world (env:// from torchrun)
    argv = [sys.executable, __file__, "server", "--backend", args.backend, "--tp-port", str(args.tp_port),
            "--weights-port", str(args.weights_port), "--timeout", str(args.timeout)]
    server = subprocess.Popen(argv, env=launch_env())
    # gloo: both ends share one GPU here, and NCCL refuses two ranks of a group on one device.
    group = rendezvous_group_as_rank0("127.0.0.1", args.weights_port, 2, WEIGHT_GROUP, "gloo", timeout)
    payload = torch.arange(1024, dtype=torch.float32)
    dist.broadcast(payload, src=0, group=group)
    rc = server.wait(timeout=args.timeout)
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    print(f"WORKER {'OK' if rc == 0 else 'FAIL'} {float(payload.sum())} server_rc={rc}", flush=True)
    return rc


def server(args) -> int:
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
    timeout = datetime.timedelta(seconds=args.timeout)
    # SGLang's model runner: its own TP group over tcp:// (parallel_state.init_distributed_environment),
    # one collective on it so that NCCL's communicator is really built.
    if args.backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.tp_port}", world_size=1, rank=0,
                            timeout=timeout)
    probe = torch.ones(8, device=_device(args.backend))
    dist.all_reduce(probe)
    # SGLang's /init_weights_update_group: rendezvous on tcp:// as rank 1, a store prefixed by the name.
    store, rank, world = next(dist.rendezvous(f"tcp://127.0.0.1:{args.weights_port}", 1, 2, timeout=timeout))
    group, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), PrefixStore(WEIGHT_GROUP, store),
                                         group_name=WEIGHT_GROUP, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    got = torch.empty(1024, dtype=torch.float32)
    dist.broadcast(got, src=0, group=group)
    expected = float(torch.arange(1024, dtype=torch.float32).sum())
    print(f"SERVER tp_group={args.backend} probe={float(probe.sum())} received {float(got.sum())}", flush=True)
    # Tear down before exit: a gloo group left to the interpreter's shutdown can abort the process.
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return 0 if float(got.sum()) == expected else 1


def consumer(args) -> int:
    from multiprocessing.reduction import ForkingPickler

    from megatron_rl.rollout.sglang_payload import unflatten_bucket
    params: dict[str, torch.Tensor] = {}
    for line in sys.stdin:
        check, encoded = line.split()  # "C <payload>": answer with the checksum; "-": copy only
        data = ForkingPickler.loads(base64.b64decode(encoded))
        named = unflatten_bucket(data["flattened_tensor"], data["metadata"])
        total = 0
        for name, view in named:
            if name not in params:
                params[name] = torch.empty_like(view)
            params[name].copy_(view)
            total += checksum(params[name]) if check == "C" else 0
        cuda = view.is_cuda
        del data, named, view
        allocated, used = 0, 0  # CPU tensors (the dry mode): shared-memory files, no device
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()  # drop the producer's blocks this process still maps
            free, size = torch.cuda.mem_get_info()
            allocated, used = torch.cuda.memory_allocated(), size - free
        print(json.dumps({"checksum": total, "allocated": allocated, "device_used": used}), flush=True)
    return 0


def watcher(args) -> int:
    torch.cuda.init()
    for _ in sys.stdin:
        free, size = torch.cuda.mem_get_info()
        print(size - free, flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("worker", "server", "consumer", "watcher"))
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--tp-port", type=int, default=0)
    ap.add_argument("--weights-port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    return {"worker": worker, "server": server, "consumer": consumer, "watcher": watcher}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
