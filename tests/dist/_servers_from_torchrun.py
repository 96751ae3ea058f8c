"""A torchrun worker that launches its servers as a colocated owner does (build_servers, then the
engine's start and health wait); the servers are sglang_dist_standin.py. Writes <out>/<rank>.json.

    torchrun ... _servers_from_torchrun.py OUT BASE_PORT NUM_SERVERS [extra_args as JSON]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DOUBLES = Path(__file__).resolve().parents[1] / "doubles"


def main() -> None:
    import torch.distributed as dist

    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_server import build_servers, wait_healthy

    out, base, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else []
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")  # the trainer's own world, on torchrun's store (MASTER_PORT)
    cfg = SGLangConfig(base_port=base + rank * count, num_servers=count, startup_timeout_s=90.0,
                       server_command=[sys.executable, str(DOUBLES / "sglang_dist_standin.py")],
                       extra_args=["--dist-timeout", "15", *extra])
    result: dict = {"master_port": os.environ["MASTER_PORT"],
                    "use_agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
    servers = []
    try:
        servers = build_servers(cfg, "unused-model", "key", seed=0, log_dir=out / f"logs{rank}")
        result["argv"] = [s.process.argv for s in servers]
        for server in servers:
            server.process.start()
        wait_healthy(servers, cfg.startup_timeout_s)
        result["healthy"] = True
    except (RuntimeError, ValueError) as err:
        result.update(healthy=False, error=f"{type(err).__name__}: {err}")
    finally:
        for server in servers:
            server.process.stop()
    (out / f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
