"""What an SGLang 0.5.23 server does between its launch and its first /health answer, reduced to the
boundary with torch.distributed (a test stand-in; the real server needs a GPU or its own venv).

Launched with the project's own server arguments (`rollout.sglang.server_command`), it:

1. takes its rendezvous port from --nccl-port, or else draws a free one from 22000-29999 as SGLang
   does (srt/server_args.py PortArgs.init_new -> utils/network.py get_free_port_below_ephemeral);
2. forms its own world, rank 0 of 1 (tp = pp = 1), on tcp://<--host>:<port>, as SGLang's scheduler
   always does, tp = 1 included (srt/distributed/bootstrap.py _resolve_dist_init_method ->
   parallel_state.py init_distributed_environment: torch.distributed.init_process_group(backend,
   init_method, world_size, rank, timeout)), with --dist-timeout seconds (SGLang's own flag) as
   the timeout: gloo here where SGLang takes nccl;
3. then answers GET /health with 200 until --lifetime-s has passed.

Everything else on the command line is accepted and ignored. A failed rendezvous ends the process
with the error on stderr, as SGLang's scheduler does (the launcher's log shows it).
"""

from __future__ import annotations

import argparse
import datetime
import random
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from double_http import QuietHandler, serve  # noqa: E402


def free_port_below_ephemeral(low: int = 22000, high: int = 29999) -> int:
    for port in random.sample(range(low, high + 1), 64):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 22000-29999")


class Health(QuietHandler):
    def do_GET(self):
        if self.path.startswith("/health"):
            self.reply(200, "")
        else:
            self.reply(404, {"error": self.path})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--nccl-port", type=int, default=None)
    ap.add_argument("--dist-timeout", type=int, default=1800)
    ap.add_argument("--lifetime-s", type=float, default=120.0)
    args, _ = ap.parse_known_args()
    port = args.nccl_port if args.nccl_port is not None else free_port_below_ephemeral()
    import torch.distributed as dist

    dist.init_process_group(backend="gloo", init_method=f"tcp://{args.host}:{port}", world_size=1, rank=0,
                            timeout=datetime.timedelta(seconds=args.dist_timeout))
    serve(Health, args.host, args.port, args.lifetime_s, f"stand-in ready on {args.port}, dist port {port}")


if __name__ == "__main__":
    main()
