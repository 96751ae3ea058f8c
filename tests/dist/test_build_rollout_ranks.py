"""build_rollout on 2 real gloo ranks of one host, colocated SGLang (server doubles): the owner
converts the rollout checkpoint once and starts the host's servers, both ranks wait on the gloo
world, then the other rank attaches to those servers as a client and owns no transport."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from doubles.sglang_testing import API_KEY, SERVER_COMMAND, free_port_block  # noqa: E402


def _worker(rank: int, world_size: int, model_dir: str, log_dir: str, port: int) -> dict:
    import torch.distributed as dist

    from megatron_rl.config import load_config
    from megatron_rl.loop import build
    from megatron_rl.rollout import sglang_checkpoint

    os.environ["MEGATRON_RL_SGLANG_API_KEY"] = API_KEY
    dist.init_process_group("gloo")
    groups = SimpleNamespace(world=dist.new_group(backend="gloo"))  # a group of its own, not the default one
    conversions = []
    real = sglang_checkpoint.rollout_checkpoint

    def counted(cfg, path):  # who converts, and whether the owner's servers find the result
        conversions.append(rank)
        return real(cfg, path)
    sglang_checkpoint.rollout_checkpoint = counted
    from megatron_rl import collectives

    waits, real_barrier = [], collectives.barrier

    def barrier(group):  # which group carries each wait: the gloo world handed in, never the default group
        waits.append("world" if group is groups.world else repr(group))
        real_barrier(group)
    collectives.barrier = barrier
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megatron_rl.loop.build").addHandler(handler)
    logging.getLogger("megatron_rl.loop.build").setLevel(logging.INFO)
    command = "[" + ",".join(f"'{c}'" for c in SERVER_COMMAND) + "]"
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=colocated", "rollout.sglang.weight_transport=disk",
                             f"rollout.sglang.disk_dir={log_dir}/weights", f"rollout.sglang.server_command={command}",
                             f"rollout.sglang.base_port={port}", "rollout.sglang.startup_timeout_s=120",
                             f"log.dir={log_dir}"])
    engine, transport, placement = build.build_rollout(cfg, Path(model_dir),
                                                       SimpleNamespace(world_size=world_size, rank=rank), groups)
    collectives.barrier = real_barrier
    try:
        (line,) = [m for m in lines if m.startswith("placement ")]
        out = {"role": placement.rollout_role(rank), "servers": [s.url for s in engine.servers], "waits": waits,
               "line": json.loads(line.removeprefix("placement ")),
               "transport": type(transport).__name__, "conversions": conversions,
               "launched": [s.process is not None for s in engine.servers]}
        # colocated tensor transport (CUDA IPC on a GPU): the host's ranks gather to the owner
        tensor = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=colocated",
                                    "rollout.sglang.weight_transport=tensor"])
        ranks = SimpleNamespace(world_size=world_size, rank=rank, pp_size=1)
        sink = SimpleNamespace(gather=None)
        peer = build.wire_ipc_gather(tensor, placement, ranks, groups, sink)
        out.update(peer=getattr(peer, "__name__", type(peer).__name__), gather=type(sink.gather).__name__,
                   gather_src=getattr(sink.gather, "src", None))
        untouched = SimpleNamespace(gather=None)  # disk transport, or PP > 1 stages: nothing wired
        out["not_wired"] = [build.wire_ipc_gather(c, placement, p, groups, untouched) is None and untouched.gather is None
                            for c, p in ((cfg, ranks), (tensor, SimpleNamespace(world_size=world_size, rank=rank,
                                                                                 pp_size=2)))]
        dist.barrier()  # the client is done with the servers before the owner stops them
        return out
    finally:
        engine.shutdown()


@pytest.mark.timeout(240)
def test_the_owner_starts_the_hosts_servers_and_the_other_rank_attaches(qwen2_dir, tmp_path):
    port = free_port_block(2)
    owner, client = run_distributed(_worker, world_size=2, args=(str(qwen2_dir), str(tmp_path), port), timeout_s=200)
    servers = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    assert (owner["role"], owner["transport"], owner["launched"]) == ("owner", "DiskTransport", [True, True])
    assert sorted(owner["servers"]) == servers
    assert (client["role"], client["transport"], client["launched"]) == ("client", "NoneType", [False, False])
    assert client["servers"] == [servers[1], servers[0]]  # its own GPU's server first
    assert owner["conversions"] == [0, 0] and client["conversions"] == [1]  # rank 0 converts before the owners
    assert (owner["peer"], owner["gather"], owner["gather_src"]) == ("NoneType", "GlooGather", 0)
    assert (client["peer"], client["gather"]) == ("peer", "NoneType")  # it sends its own copy to rank 0
    assert owner["not_wired"] == client["not_wired"] == [True, True]
    assert owner["waits"] == client["waits"] == ["world", "world"]  # after the conversion, after the servers' start
    pid = {"owner": owner["line"]["pid"], "client": client["line"]["pid"]}
    assert owner["line"] == {"rank": 0, "host": "127.0.0.1", "pid": pid["owner"], "local_rank": 0, "role": "owner",
                             "owned_servers": servers, "servers": servers}
    assert client["line"] == {"rank": 1, "host": "127.0.0.1", "pid": pid["client"], "local_rank": 1,
                              "role": "client", "owned_servers": [], "servers": [servers[1], servers[0]]}
