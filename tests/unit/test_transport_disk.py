"""Disk transport into the embedded torch engine: atomic versioned folders, replay, check mode."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.rollout.torch_engine import TorchRolloutEngine
from megatron_rl.sync.buckets import iter_buckets
from megatron_rl.sync.disk_transport import INDEX, DiskTransport
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout
from megatron_rl.sync.transport import tensor_digest
from megatron_rl.sync.weight_sync import WeightSync

pytestmark = pytest.mark.timeout(60)


class _Actor:
    """Stands in for the Megatron actor at the export seam: yields HF-named weights."""

    parallel = type("P", (), {"pp_size": 1})()

    def __init__(self, weights):
        self.weights = weights

    def export_hf_weights(self):
        return iter(sorted(self.weights.items()))


def test_weight_sync_over_disk_publishes_versions_and_checks(qwen2_dir, tmp_path):
    from safetensors.torch import load_file

    weights = load_file(str(qwen2_dir / "model.safetensors"))
    engine = TorchRolloutEngine(qwen2_dir, rollout_quant="fp8_blockwise")
    root = tmp_path / "snapshots"
    transport = DiskTransport(engine, root, template_dir=qwen2_dir, keep=1)
    sync = WeightSync(_Actor(weights), transport, RolloutQuantSpec("fp8_blockwise"), bucket_mb=0.02, check=True)
    for version in (1, 2):
        for name in weights:
            weights[name] = weights[name] + 0.01
        metrics = sync.sync()
        assert metrics["sync/check_mismatches"] == 0.0 and metrics["sync/num_buckets"] > 2
    assert sorted(p.name for p in root.iterdir()) == ["v000002"]  # keep=1 pruned v1, no staging left
    folder = root / "v000002"
    index = json.loads((folder / INDEX).read_text())
    assert index["metadata"]["weight_version"] == 2 and (folder / "config.json").is_file()
    sent = dict(quantize_for_rollout(sorted(weights.items()), RolloutQuantSpec("fp8_blockwise")))
    assert set(index["weight_map"]) == set(sent)
    assert engine.weight_version == 2
    assert engine.checksum(sorted(sent)) == {n: tensor_digest(t) for n, t in sent.items()}


def test_a_crashed_write_never_becomes_a_version(qwen2_dir, tmp_path):
    engine = TorchRolloutEngine(qwen2_dir)
    transport = DiskTransport(engine, tmp_path)
    transport.begin(1)
    transport.send([("model.norm.weight", torch.ones(64))], 1)
    # the trainer dies here: only the staging folder exists, and a new attempt starts clean
    assert [p.name for p in tmp_path.iterdir()] == [".v000001.tmp"]
    transport.begin(1)
    assert list((tmp_path / ".v000001.tmp").iterdir()) == []
    assert engine.weight_version == 0
    for bucket in iter_buckets([("model.norm.weight", torch.full((64,), 2.0))], 1024):
        transport.send(bucket, 1)
    transport.finish(1)
    assert engine.weight_version == 1 and [p.name for p in tmp_path.iterdir()] == ["v000001"]
