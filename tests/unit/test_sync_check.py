"""Weight-sync check mode compares the bytes the engine holds with the bytes that were sent: one
flipped byte, or a tensor the engine never received (so it still serves the old one), must raise."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.rollout.torch_engine import TorchRolloutEngine
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout
from megatron_rl.sync.transport import InProcessTransport, tensor_digest
from megatron_rl.sync.weight_sync import WeightSync, WeightSyncError

pytestmark = pytest.mark.timeout(120)

QUANT = RolloutQuantSpec("fp8_blockwise")


class _FaultyTransport(InProcessTransport):
    """Delivers buckets like InProcessTransport, but corrupts or drops the tensor `target`."""

    def __init__(self, engine, target: str, fault: str) -> None:
        super().__init__(engine)
        self.target, self.fault = target, fault

    def send(self, bucket, version: int) -> None:
        out = []
        for name, t in bucket:
            if name == self.target and self.fault == "drop":
                continue
            if name == self.target:
                t = t.detach().clone()
                t.reshape(-1).view(torch.uint8)[0] ^= 1  # the lowest bit of the first byte
            out.append((name, t))
        super().send(out, version)


@pytest.fixture
def actor(qwen2_dir, single_parallel):
    return MegatronActor.build(qwen2_dir, parallel=single_parallel)


def _sync(actor, qwen2_dir, target: str | None = None, fault: str = "flip"):
    engine = TorchRolloutEngine(qwen2_dir, rollout_quant="fp8_blockwise")
    transport = InProcessTransport(engine) if target is None else _FaultyTransport(engine, target, fault)
    return engine, WeightSync(actor, transport, QUANT, bucket_mb=0.02, check=True)


def test_check_passes_when_the_engine_holds_the_sent_bytes(actor, qwen2_dir):
    engine, sync = _sync(actor, qwen2_dir)
    assert sync.sync()["sync/check_mismatches"] == 0.0
    sent = dict(quantize_for_rollout(actor.export_hf_weights(), QUANT))
    assert engine.checksum(sorted(sent)) == {n: tensor_digest(t) for n, t in sent.items()}


@pytest.mark.parametrize("target", ["model.layers.0.mlp.down_proj.weight",  # FP8 bytes
                                    "model.layers.0.mlp.down_proj.weight_scale_inv",  # its FP32 scale
                                    "model.norm.weight"])  # a high-precision tensor
def test_check_raises_on_one_flipped_byte(actor, qwen2_dir, target):
    engine, sync = _sync(actor, qwen2_dir, target, "flip")
    with pytest.raises(WeightSyncError, match=target.replace(".", r"\.")):
        sync.sync()


def test_check_raises_on_a_tensor_the_engine_did_not_receive(actor, qwen2_dir):
    """The engine keeps serving the old tensor: same name, stale bytes (the engine itself refuses a
    half-sent FP8 weight + scale pair, so a high-precision tensor is the silent case)."""
    target = "model.layers.1.post_attention_layernorm.weight"  # an FP8 pair cannot go half-sent
    engine, sync = _sync(actor, qwen2_dir, target, "drop")
    with torch.no_grad():
        for param in actor.model[0].parameters():
            param.add_(0.01)
    with pytest.raises(WeightSyncError, match=target.replace(".", r"\.")):
        sync.sync()


def test_digest_leaves_the_tensor_resizable():
    """The colocated offload frees storages by resizing them; hashing must not pin them."""
    import torch

    from megatron_rl.rollout.base import tensor_digest

    t = torch.arange(6, dtype=torch.float32)
    tensor_digest(t)
    assert t.untyped_storage().resizable()


class _RecordingTransport(InProcessTransport):
    """InProcessTransport that records the protocol calls: (call, version, tensor names)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.calls = []

    def begin(self, version: int) -> None:
        self.calls.append(("begin", version, None))
        super().begin(version)

    def send(self, bucket, version: int) -> None:
        self.calls.append(("send", version, [n for n, _ in bucket]))
        super().send(bucket, version)

    def finish(self, version: int) -> None:
        self.calls.append(("finish", version, None))
        super().finish(version)


def test_each_sync_is_one_version_in_buckets_of_the_budget_with_its_size_counted(actor, qwen2_dir, monkeypatch):
    from megatron_rl import collectives

    barriers = []
    monkeypatch.setattr(collectives, "barrier", lambda group=None: barriers.append(group))
    engine = TorchRolloutEngine(qwen2_dir, rollout_quant="fp8_blockwise", kv_cache_dtype="fp8_e4m3")
    transport = _RecordingTransport(engine)
    scales = [("model.layers.0.self_attn.k_scale", torch.tensor(0.5)), ("model.layers.0.self_attn.v_scale", torch.tensor(2.0))]
    sync = WeightSync(actor, transport, QUANT, bucket_mb=0.02, kv_scales=lambda: scales)
    sent = [*quantize_for_rollout(actor.export_hf_weights(), QUANT), *scales]
    total = sum(t.numel() * t.element_size() for _, t in sent)
    # by hand: greedy buckets of at most 0.02 MiB (a scale joins its weight)
    budget, expected, size = int(0.02 * 2**20), [[]], 0
    for name, t in sent:
        nbytes = t.numel() * t.element_size()
        if expected[-1] and size + nbytes > budget and not name.endswith(("_scale_inv", ".weight_scale")):
            expected.append([])
            size = 0
        expected[-1].append(name)
        size += nbytes
    assert len(expected) > 2  # several buckets: a wrong budget shows
    for version in (1, 2):
        t0 = time.perf_counter()
        metrics = sync.sync()
        wall = time.perf_counter() - t0
        assert 0 < metrics["sync/seconds"] <= wall
        assert metrics["sync/gb_per_s"] == pytest.approx(total / metrics["sync/seconds"] / 1e9)
        assert "sync/check_mismatches" not in metrics  # check mode is off unless asked
        calls = transport.calls[-(len(expected) + 2):]
        assert calls == [("begin", version, None), *(("send", version, b) for b in expected), ("finish", version, None)]
        assert (metrics["sync/version"], metrics["sync/bytes"], metrics["sync/num_buckets"]) == (version, total, len(expected))
        assert sync.version == version == engine.weight_version
    assert len(transport.calls) == 2 * (len(expected) + 2) and barriers == []  # no clients: no barrier


def test_a_rank_without_a_transport_feeds_its_peer_and_waits_for_the_owners(actor, monkeypatch):
    from megatron_rl import collectives

    barriers, fed = [], []
    monkeypatch.setattr(collectives, "barrier", lambda group=None: barriers.append(group))
    sync = WeightSync(actor, None, QUANT, bucket_mb=0.02, wait_for_owners=True, wait_group="world",
                      peer=lambda bucket: fed.append([n for n, _ in bucket]))
    metrics = sync.sync()
    names = [n for n, _ in quantize_for_rollout(actor.export_hf_weights(), QUANT)]
    assert [n for b in fed for n in b] == names and len(fed) > 2  # every bucket, in order
    assert (metrics["sync/bytes"], metrics["sync/num_buckets"], metrics["sync/version"]) == (0.0, 0.0, 1.0)
    assert barriers == ["world"]  # once per sync, on the given group, after the buckets
    sync.sync()
    assert barriers == ["world", "world"]


def test_close_releases_what_the_transport_holds_and_nothing_else():
    closed = []

    class _Holding:
        def close(self):
            closed.append(True)

    WeightSync(None, _Holding(), RolloutQuantSpec()).close()
    assert closed == [True]
    WeightSync(None, InProcessTransport(None), RolloutQuantSpec()).close()  # holds nothing to release
    WeightSync(None, None, RolloutQuantSpec()).close()  # a rank without a transport
