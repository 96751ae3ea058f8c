"""Run a function on N real processes joined in a gloo group (torchrun-style env vars), for tests.

    def worker(rank: int, world_size: int, arg) -> dict: ...   # module-level, importable
    results = run_distributed(worker, world_size=2, args=(arg,), timeout_s=180)

Each child gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (a free loopback port)
and OMP_NUM_THREADS=1, calls worker(rank, world_size, *args), and sends back its return value
(torch.save, read back with weights_only=True: return tensors, numbers, strings
and containers of them). The worker may or may not initialize
torch.distributed itself (megatron_rl.actor.parallel.init_parallel reads these variables); the
launcher destroys the group if the worker left it open. A child that raises fails the call with
its traceback; a child still running after timeout_s is killed and the call fails.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including assertion failures, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (),
                    timeout_s: float = 180.0) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size spawned processes; results in rank order."""
    import torch

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, rank, world_size, port, args, queue), daemon=False)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[rank] for rank in range(world_size)]
