"""Colocated tensor transport on 2 real gloo processes (one host, 2 GPUs, 2 server doubles): each
server is updated from the payload of the rank on its own GPU, never from the owner's copy alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
pytestmark = pytest.mark.timeout(300)


def _weights(model_dir: str, factor: float):
    from safetensors.torch import load_file

    return [(n, t * factor) for n, t in sorted(load_file(str(Path(model_dir) / "model.safetensors")).items())]


def _worker(rank: int, world_size: int, model_dir: str) -> dict:
    import torch.distributed as dist
    from test_transport_sglang import as_held, run_sync

    from megatron_rl.sync.buckets import iter_buckets
    from megatron_rl.sync.sglang_transport import GlooGather, SGLangTensorTransport, ipc_peer

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1], backend="gloo")
    # Each rank's copy differs here only so the test can tell whose payload a server got (in a run
    # every rank holds the same all-gathered weights, each on its own GPU).
    named = _weights(model_dir, 1 + rank)
    if rank == 1:
        peer = ipc_peer(group, 0)
        for bucket in iter_buckets(named, 16 * 1024):
            peer(bucket)
        return {}
    from sglang_testing import make_engine

    engine = make_engine(Path(model_dir), num_servers=2)
    try:
        run_sync(SGLangTensorTransport(engine, gather=GlooGather(group, 0)), named, 1)
        held = [s.client.get("/_double/hf_digests") for s in engine.servers]
        expected = [as_held(_weights(model_dir, 1 + r)) for r in (0, 1)]
        return {"match": [{n: h[n] for n in e} == e for h, e in zip(held, expected)]}
    finally:
        engine.shutdown()


def test_each_server_gets_the_payload_of_its_own_gpu(qwen2_dir):
    r0, _ = run_distributed(_worker, world_size=2, args=(str(qwen2_dir),), timeout_s=300)
    assert r0["match"] == [True, True]


def test_payload_slices_follow_the_servers_gpus():
    from megatron_rl.sync.sglang_transport import payloads_for_server

    host = ["g0", "g1", "g2", "g3"]
    assert payloads_for_server(host, 1, 2) == ["g2", "g3"] and payloads_for_server(host, 3, 1) == ["g3"]
    assert payloads_for_server(["a", "b"], 5, 2) == ["a", "b"]  # one server group's own gather
    with pytest.raises(ValueError, match="no slice for server 2"):
        payloads_for_server(host, 2, 2)
