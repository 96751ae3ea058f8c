"""SGLang tensor / NCCL transports and the flattened-bucket wire format, against the SGLang double.

The double starts from a block-FP8 checkpoint (tools/convert_hf_to_fp8.py, 32x32 blocks so the tiny
model's q/k/v rows divide), as colocated and disaggregated servers must for FP8 updates to land."""

from __future__ import annotations

import io
import logging
import pickle
import threading
import time

import pytest
import torch

import sglang_protocol as proto
from sglang_testing import DOUBLES_TIMEOUT_S, free_port_block, make_engine, needs_sglang_source

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_client import ServerUnavailable
from megatron_rl.rollout.sglang_payload import (distributed_spec, flatten_bucket, serialize_flattened,
                                                unflatten_bucket)
from megatron_rl.sync.buckets import iter_buckets
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout
from megatron_rl.sync.transport import tensor_digest

pytestmark = [needs_sglang_source, pytest.mark.timeout(DOUBLES_TIMEOUT_S)]
GROUP_TIMEOUT_S = 60  # a weight group's rendezvous and broadcasts: seconds here; a broken one fails, not hangs


def test_flattening_orders_by_element_size_so_offsets_stay_aligned():
    fp8 = torch.ones(3, dtype=torch.float32).to(torch.float8_e4m3fn)  # 3 bytes: would misalign what follows
    bucket = [("a.weight", fp8), ("a.weight_scale_inv", torch.tensor([[2.0]])), ("n.weight", torch.ones(2, dtype=torch.bfloat16))]
    flat, meta = flatten_bucket(bucket)
    assert [(m.name, m.start_idx, m.end_idx) for m in meta] == [
        ("a.weight_scale_inv", 0, 4), ("n.weight", 4, 8), ("a.weight", 8, 11)]
    assert flat.dtype == torch.uint8 and flat.numel() == 11
    assert distributed_spec(bucket) == {"names": ["a.weight_scale_inv", "n.weight", "a.weight"],
                                        "dtypes": ["float32", "bfloat16", "float8_e4m3fn"],
                                        "shapes": [[1, 1], [2], [3]]}
    back = dict(unflatten_bucket(flat, meta))
    assert back["a.weight_scale_inv"].item() == 2.0 and back["a.weight"].dtype == torch.float8_e4m3fn
    assert back["n.weight"].tolist() == [1.0, 1.0]


def test_payload_pickle_uses_only_globals_sglang_unpickles():
    seen = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append((module, name))
            return super().find_class(module, name)

    flat, meta = flatten_bucket([("w", torch.randn(4, 4)), ("s", torch.ones(1, 1))])
    import base64
    Recorder(io.BytesIO(base64.b64decode(serialize_flattened(flat, meta)))).load()
    assert seen and set(seen) <= proto.unpickler_allowed_globals(), set(seen) - proto.unpickler_allowed_globals()


BLOCK = (32, 32)
SESSION = ["/pause_generation", "/flush_cache", "/begin_weight_update"]
CLOSE = ["/end_weight_update", "/flush_cache", "/continue_generation"]


@pytest.fixture(scope="module")
def fp8_dir(qwen2_dir, tmp_path_factory):
    from megatron_rl.convert.hf_to_fp8 import convert_hf_to_fp8

    out = tmp_path_factory.mktemp("qwen2_fp8")
    convert_hf_to_fp8(qwen2_dir, out, block_size=BLOCK)
    return out


@pytest.fixture(scope="module")
def engine(fp8_dir):
    # --health-generate-s: a probe of /health_generate is a request in flight for that long
    eng = make_engine(fp8_dir, extra_by_server={0: ["--defer-copies", "--health-generate-s", "4"]})
    yield eng
    eng.shutdown()


def payload(model_dir, version: int) -> list[tuple[str, torch.Tensor]]:
    """The model's HF weights moved by `version` * 0.01 noise, quantized as the precision contract says."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(version)
    weights = load_file(str(model_dir / "model.safetensors"))
    moved = [(n, t + 0.01 * version * torch.randn(t.shape, generator=gen)) for n, t in sorted(weights.items())]
    return list(quantize_for_rollout(moved, RolloutQuantSpec("fp8_blockwise", BLOCK)))


def as_held(named) -> dict[str, str]:
    """Digests of what the server should hold: FP8 weights and float32 scales as sent, the rest in
    float16 (SGLang's --dtype auto for a float32 config)."""
    keep = (torch.float8_e4m3fn,)
    return {n: tensor_digest(t if t.dtype in keep or n.endswith("_scale_inv") else t.to(torch.float16))
            for n, t in named}


def held_digests(engine) -> dict[str, str]:
    return engine.servers[0].client.get("/_double/hf_digests")


def served_versions(engine) -> list[str]:
    """The weight version each server reports (SGLang tags every /generate answer with it, and the
    engine refuses a sample whose tag is not its own version)."""
    return [s.client.get("/model_info")["weight_version"] for s in engine.servers]


def requests_seen(engine) -> list[str]:
    log = engine.servers[0].client.get("/_double/log")
    return [p for p in log if p not in ("/health", "/weights_checker", "/server_info") and not p.startswith("/_double")]


def run_sync(transport, named, version: int, bucket_bytes: int = 16 * 1024) -> int:
    transport.begin(version)
    buckets = list(iter_buckets(named, bucket_bytes))
    for bucket in buckets:
        transport.send(bucket, version)
    transport.finish(version)
    return len(buckets)


def test_tensor_transport_delivers_exactly_what_was_sent(engine, qwen2_dir):
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    named = payload(qwen2_dir, 1)
    transport = SGLangTensorTransport(engine, check=True)
    before = len(requests_seen(engine))
    num_buckets = run_sync(transport, named, 1)
    assert num_buckets > 2
    assert requests_seen(engine)[before:] == SESSION + ["/update_weights_from_tensor"] * num_buckets + CLOSE
    held = held_digests(engine)
    assert {n: held[n] for n, _ in named} == as_held(named)
    assert transport.checksums([n for n, _ in named]) == {n: tensor_digest(t) for n, t in named}
    assert engine.weight_version == 1 and served_versions(engine) == ["1"] * len(engine.servers)
    sample = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert len(sample.rollout_logprobs) == 3


def test_the_engine_protocol_sends_buckets_in_one_session_and_flushes_once_at_the_end(engine, qwen2_dir):
    """RolloutEngine's own protocol on SGLang (pause, update_weights per bucket, finish_update,
    resume): the first bucket opens the update session; each goes to /update_weights_from_tensor
    tagged with the version and with flush_cache off, so a request in flight (here a health probe
    of /health_generate, which SGLang counts as one) does not fail the update; the one flush comes
    at finish_update and is retried until the probe is done."""
    version = engine.weight_version + 1
    named = payload(qwen2_dir, version)
    buckets = list(iter_buckets(named, 64 * 1024))
    before = len(requests_seen(engine))
    checksums = [r["per_engine_checksum"] for r in engine.check_weights()]
    engine.pause()
    probe = threading.Thread(target=engine.servers[0].client.get, args=("/health_generate",))
    probe.start()
    while "/health_generate" not in requests_seen(engine)[before:]:
        time.sleep(0.05)
    time.sleep(0.5)  # the probe is in flight (4 s) while the buckets go
    for bucket in buckets:
        engine.update_weights(bucket, version)
    engine.finish_update(version)
    engine.resume()
    probe.join()
    seen = requests_seen(engine)[before:]
    flushes = seen.count("/flush_cache")
    assert len(buckets) > 1 and flushes >= 2  # the first flush came while the probe ran: refused
    assert seen == (["/pause_generation", "/health_generate", "/begin_weight_update"]
                    + ["/update_weights_from_tensor"] * len(buckets)
                    + ["/end_weight_update"] + ["/flush_cache"] * flushes + ["/continue_generation"])
    held = held_digests(engine)
    assert {n: held[n] for n, _ in named} == as_held(named)
    assert engine.weight_version == version and served_versions(engine) == [str(version)]
    sample = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0]
    assert len(sample.response_ids) == 2
    after = [r["per_engine_checksum"] for r in engine.check_weights()]
    assert len(after) == 1 and after != checksums  # a checksum of what is held: it moved with the update


def test_tensor_transport_refuses_tp_servers_without_a_gather(monkeypatch):
    """SGLang's TP rank r opens only payload r, a handle on its own GPU: one payload for a TP=2
    server would leave rank 1 without weights. Refused before any server is paused; a gather over
    the server's GPUs passes the check."""
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", "k")
    engine = SGLangEngine(SGLangConfig(server_urls=["http://127.0.0.1:9"], tp_size=2), "unused", start=False)
    with pytest.raises(ValueError) as refused:
        SGLangTensorTransport(engine).begin(1)
    assert str(refused.value) == (
        "rollout.sglang.tp_size > 1 with the tensor transport: SGLang's TP rank r opens only payload r "
        "(managers/tp_worker.py deserialize_own_rank), a handle of memory on its own GPU; give the "
        "transport a gather over the server's GPUs (GlooGather)")
    SGLangTensorTransport(engine, gather=lambda payload: None)._check_gather()


def test_reusing_the_ipc_buffer_corrupts_weights(engine, qwen2_dir):
    """Why the transport never reuses a buffer: the server copies later than it answers."""
    named = dict(payload(qwen2_dir, 2))
    a = ("model.layers.0.input_layernorm.weight", named["model.layers.0.input_layernorm.weight"])
    b = ("model.layers.1.input_layernorm.weight", named["model.layers.1.input_layernorm.weight"])
    assert not torch.equal(a[1], b[1])
    client = engine.servers[0].client
    client.post("/begin_weight_update", {})
    flat, meta = flatten_bucket([a])
    client.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialize_flattened(flat, meta)],
                                                "load_format": "flattened_bucket", "weight_version": "2"})
    flat.copy_(flatten_bucket([b])[0])  # the next bucket written into the same buffer
    client.post("/end_weight_update", {})
    assert held_digests(engine)[a[0]] == as_held([b])[b[0]] != as_held([a])[a[0]]


def test_nccl_transport_broadcasts_flattened_buckets(engine, qwen2_dir):
    from megatron_rl.sync.sglang_transport import SGLangNcclTransport

    transport = SGLangNcclTransport(engine, "127.0.0.1", free_port_block(2), backend="gloo", check=True,
                                    timeout_s=GROUP_TIMEOUT_S)
    for version in (3, 4):
        named = payload(qwen2_dir, version)
        before = len(requests_seen(engine))
        num_buckets = run_sync(transport, named, version)
        init = ["/init_weights_update_group"] if version == 3 else []
        assert requests_seen(engine)[before:] == (SESSION[:2] + init + SESSION[2:] + ["/update_weights_from_distributed"] * num_buckets
                                                  + CLOSE)
        held = held_digests(engine)
        assert {n: held[n] for n, _ in named} == as_held(named)
        assert transport.checksums([n for n, _ in named]) == {n: tensor_digest(t) for n, t in named}
    assert engine.weight_version == 4 and served_versions(engine) == ["4"] * len(engine.servers)
    transport.close()
    assert requests_seen(engine)[-1] == "/destroy_weights_update_group" and transport.group is None
    transport.close()  # a second close has nothing left to do
    assert requests_seen(engine)[-1] == "/destroy_weights_update_group"
    again = SGLangNcclTransport(engine, "127.0.0.1", free_port_block(2), backend="gloo", check=True,
                                timeout_s=GROUP_TIMEOUT_S)
    again._init_group()  # the servers and this rank form the group under the same name again
    assert again._name() == "megatron_rl_weights_0" and requests_seen(engine)[-1] == "/init_weights_update_group"
    again.close()


def test_disk_transport_to_sglang_loads_the_published_folder(engine, qwen2_dir, tmp_path):
    from megatron_rl.sync.disk_transport import DiskTransport

    named = payload(qwen2_dir, 5)
    transport = DiskTransport(engine, tmp_path / "weights", template_dir=qwen2_dir)
    before = len(requests_seen(engine))
    run_sync(transport, named, 5)
    assert requests_seen(engine)[before:] == ["/pause_generation", "/update_weights_from_disk",
                                              "/flush_cache", "/continue_generation"]
    held = held_digests(engine)
    assert {n: held[n] for n, _ in named} == as_held(named)
    assert transport.checksums([n for n, _ in named]) == {n: tensor_digest(t) for n, t in named}
    assert engine.weight_version == 5 and served_versions(engine) == ["5"] * len(engine.servers)


def test_fp8_kv_cache_refuses_an_update_without_fresh_kv_scales_only_when_asked(monkeypatch):
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", "k")
    cfg = SGLangConfig(server_urls=["http://127.0.0.1:9"], kv_cache_dtype="fp8_e4m3", kv_scales="sent")
    eng = SGLangEngine(cfg, "unused", start=False)
    eng.begin_update(1, session=False)
    with pytest.raises(ValueError) as refused:
        eng.finish_update(1)
    assert str(refused.value) == ("version 1: an FP8 KV cache needs k_scale/v_scale tensors with this update "
                                  "(rollout.sglang.kv_scales='sent'); stale KV scales silently corrupt attention")
    eng.note_sent(["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_scale",
                   "model.layers.0.self_attn.v_scale"])
    with pytest.raises(ServerUnavailable):  # past the check, the flush finds no server on port 9
        eng.finish_update(1)


def test_an_update_begins_only_above_the_held_version_and_finishes_the_one_in_progress(monkeypatch):
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", "k")
    eng = SGLangEngine(SGLangConfig(server_urls=["http://127.0.0.1:9"]), "unused", start=False)
    with pytest.raises(ValueError) as same:
        eng.begin_update(0, session=False)  # the engine holds version 0
    assert str(same.value) == "weight version 0 is not newer than the engine's 0"
    eng.begin_update(3, session=False)
    eng.begin_update(3, session=False)  # the same version again: a sync retried after a failure
    with pytest.raises(ValueError) as other:
        eng.begin_update(4, session=False)
    assert str(other.value) == "version 4 while the update to 3 is in progress"
    with pytest.raises(ValueError) as wrong:
        eng.finish_update(2)
    assert str(wrong.value) == "finish_update(2) but the update in progress is 3"


def _log_of(server) -> list[str]:
    return [p for p in server.client.get("/_double/log") if p in ("/init_weights_update_group",
                                                                   "/destroy_weights_update_group")]


def test_a_restarted_server_gets_a_fresh_group_and_every_server_its_own_ranks(fp8_dir, qwen2_dir, caplog):
    """Two servers (ranks 1 and 2 of the group); server 1 dies and is restarted with the checkpoint:
    the next sync destroys the old group on the server that still has it, forms a new one (next
    name, next port) with both, and both end up holding exactly what was sent. Then server 0 dies:
    the group moves on once more."""
    from megatron_rl.sync.sglang_transport import SGLangNcclTransport

    engine = make_engine(fp8_dir, num_servers=2)
    try:
        transport = SGLangNcclTransport(engine, "127.0.0.1", free_port_block(3), backend="gloo", check=True,
                                        timeout_s=GROUP_TIMEOUT_S)
        run_sync(transport, payload(qwen2_dir, 1), 1)
        first = transport.group
        dead = engine.servers[1]
        dead.process.proc.kill()
        dead.process.proc.wait()
        engine._check_server(dead)  # what a failed request does: restart it
        assert dead.restarts == 1 and dead.process.alive()
        named = payload(qwen2_dir, 2)
        run_sync(transport, named, 2)
        assert transport.group is not first and transport._name() == "megatron_rl_weights_1"
        assert _log_of(engine.servers[0]) == ["/init_weights_update_group", "/destroy_weights_update_group",
                                              "/init_weights_update_group"]
        assert _log_of(dead) == ["/init_weights_update_group"]  # the restarted process never had the old one
        for server in engine.servers:
            held = server.client.get("/_double/hf_digests")
            assert {n: held[n] for n, _ in named} == as_held(named), server.url
        # A second restart (the other server): the group moves on again, to the third name and port.
        other = engine.servers[0]
        other.process.proc.kill()
        other.process.proc.wait()
        engine._check_server(other)
        named = payload(qwen2_dir, 3)
        run_sync(transport, named, 3)
        assert transport._name() == "megatron_rl_weights_2"
        assert _log_of(dead) == ["/init_weights_update_group", "/destroy_weights_update_group",
                                 "/init_weights_update_group"]
        assert _log_of(other) == ["/init_weights_update_group"]
        for server in engine.servers:
            held = server.client.get("/_double/hf_digests")
            assert {n: held[n] for n, _ in named} == as_held(named), server.url
        # At the end of the run: server 1 restarted after the last sync (it never joined the current
        # group, so it is not told to leave it) and server 0 is gone (told; the failure is only logged).
        dead.process.proc.kill()
        dead.process.proc.wait()
        engine._check_server(dead)
        engine.servers[0].process.proc.kill()
        engine.servers[0].process.proc.wait()
        with caplog.at_level(logging.WARNING, logger="megatron_rl.sync.sglang_transport"):
            transport.close()  # the run does not fail
        assert transport.group is None
        assert _log_of(dead) == []
        (warning,) = [r.getMessage() for r in caplog.records if "not told" in r.getMessage()]
        assert warning.startswith("weight group megatron_rl_weights_2: servers not told to leave it (")
        assert warning.endswith(")") and not warning.endswith("(None)")
    finally:
        engine.shutdown()
