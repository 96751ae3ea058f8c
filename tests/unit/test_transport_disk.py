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


class _Recorder:
    """An engine that records the calls the transport makes (the engine side is ours: the bucket
    protocol of sync/transport.py, or SGLang's /update_weights_from_disk through SGLangEngine)."""

    def __init__(self, from_disk: bool, checksums: dict | None = None):
        self.calls: list = []
        self.weight_version = 0
        self._checksums = checksums
        if from_disk:
            self.update_weights_from_disk = lambda path, version: self.calls.append(("disk", path, version))

    def pause(self):
        self.calls.append(("pause",))

    def update_weights(self, bucket, version):
        self.calls.append(("bucket", [(n, t.tolist()) for n, t in bucket], version))

    def finish_update(self, version):
        self.calls.append(("finish", version))
        self.weight_version = version

    def resume(self):
        self.calls.append(("resume",))

    def checksum(self, names):
        if self._checksums is None:
            raise NotImplementedError
        return {n: self._checksums[n] for n in names}


def _publish(transport, version, buckets):
    transport.begin(version)
    for bucket in buckets:
        transport.send(bucket, version)
    transport.finish(version)


def test_each_bucket_is_one_shard_in_order_with_the_index_and_template(tmp_path):
    from safetensors import safe_open

    template = tmp_path / "hf"
    template.mkdir()
    (template / "config.json").write_text("{}")
    (template / "tokenizer.json").write_text("tok")
    (template / "model.safetensors").write_text("not copied")
    buckets = [[("a", torch.ones(2)), ("b", torch.zeros(3, dtype=torch.bfloat16))], [("c", torch.arange(4))]]
    engine = _Recorder(from_disk=True)
    _publish(DiskTransport(engine, tmp_path / "root", template_dir=template), 7, buckets)
    folder = tmp_path / "root" / "v000007"
    assert engine.calls == [("disk", folder, 7)]
    assert sorted(p.name for p in folder.iterdir()) == sorted([
        "config.json", INDEX, "model-00001.safetensors", "model-00002.safetensors", "tokenizer.json"])
    index = json.loads((folder / INDEX).read_text())
    assert index == {"metadata": {"total_size": 2 * 4 + 3 * 2 + 4 * 8, "weight_version": 7},
                     "weight_map": {"a": "model-00001.safetensors", "b": "model-00001.safetensors",
                                    "c": "model-00002.safetensors"}}
    with safe_open(str(folder / "model-00002.safetensors"), "pt") as f:
        assert f.metadata() == {"weight_version": "7"} and f.get_tensor("c").tolist() == [0, 1, 2, 3]
    assert (folder / "tokenizer.json").read_text() == "tok"


def test_an_engine_without_a_disk_loader_gets_the_shards_replayed_in_order(tmp_path):
    engine = _Recorder(from_disk=False)
    transport = DiskTransport(engine, tmp_path)
    _publish(transport, 3, [[("x", torch.tensor([1.0]))], [("y", torch.tensor([2.0])), ("z", torch.tensor([3.0]))]])
    assert engine.calls == [("pause",), ("bucket", [("x", [1.0])], 3),
                            ("bucket", [("y", [2.0]), ("z", [3.0])], 3), ("finish", 3), ("resume",)]
    assert not list(tmp_path.glob(".*.tmp"))


def test_begin_starts_a_fresh_index_and_a_version_can_be_published_again(tmp_path):
    engine = _Recorder(from_disk=True)
    transport = DiskTransport(engine, tmp_path)
    _publish(transport, 1, [[("a", torch.ones(2))]])
    transport.begin(2)
    transport.send([("b", torch.ones(1))], 2)
    transport.begin(2)  # a retried attempt: nothing of the first survives
    transport.send([("c", torch.ones(3))], 2)
    transport.finish(2)
    index = json.loads((tmp_path / "v000002" / INDEX).read_text())
    assert index == {"metadata": {"total_size": 12, "weight_version": 2},
                     "weight_map": {"c": "model-00001.safetensors"}}
    _publish(transport, 2, [[("d", torch.ones(1))]])  # the same version again replaces the folder
    assert json.loads((tmp_path / "v000002" / INDEX).read_text())["weight_map"] == {"d": "model-00001.safetensors"}


@pytest.mark.parametrize("keep, left", [(1, ["v000004"]), (2, ["v000003", "v000004"]), (5, ["v000001", "v000002",
                                                                                               "v000003", "v000004"])])
def test_older_versions_are_pruned_to_keep(tmp_path, keep, left):
    transport = DiskTransport(_Recorder(from_disk=True), tmp_path, keep=keep)
    (tmp_path / "other").mkdir()  # not a version folder: never pruned
    for version in (1, 2, 3, 4):
        _publish(transport, version, [[("a", torch.ones(1))]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(left + ["other"])


def test_the_just_published_version_is_never_pruned(tmp_path):
    transport = DiskTransport(_Recorder(from_disk=True), tmp_path, keep=1)
    _publish(transport, 5, [[("a", torch.ones(1))]])
    _publish(transport, 2, [[("a", torch.ones(1))]])  # a lower number than what is on disk
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000005"]


def test_checksums_come_from_the_engine_or_else_from_its_published_folder(tmp_path):
    from megatron_rl.sync.disk_transport import read_digests, version_dir

    assert version_dir(tmp_path, 12) == tmp_path / "v000012"
    engine = _Recorder(from_disk=True)
    transport = DiskTransport(engine, tmp_path)
    a, b = torch.arange(3.0), torch.ones(2)
    _publish(transport, 1, [[("a", a)], [("b", b)]])
    engine.weight_version = 1
    assert transport.checksums(["b", "a", "missing"]) == {"b": tensor_digest(b), "a": tensor_digest(a)}
    assert read_digests(tmp_path / "v000001", ["a"]) == {"a": tensor_digest(a)}
    told = DiskTransport(_Recorder(from_disk=True, checksums={"a": "engine says"}), tmp_path)
    assert told.checksums(["a"]) == {"a": "engine says"}


def test_bad_use_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"^keep must be >= 1, got 0$"):
        DiskTransport(_Recorder(from_disk=True), tmp_path, keep=0)
    assert DiskTransport(_Recorder(from_disk=True), tmp_path).keep == 2
    with pytest.raises(RuntimeError, match=r"^DiskTransport.send\(\) before begin\(\)$"):
        DiskTransport(_Recorder(from_disk=True), tmp_path).send([("a", torch.ones(1))], 1)
    transport = DiskTransport(_Recorder(from_disk=True), tmp_path / "new" / "root")
    transport.begin(1)  # creates its root
    assert (tmp_path / "new" / "root" / ".v000001.tmp").is_dir()


def test_a_send_after_finish_needs_a_new_begin(tmp_path):
    transport = DiskTransport(_Recorder(from_disk=True), tmp_path)
    _publish(transport, 1, [[("a", torch.ones(1))]])
    with pytest.raises(RuntimeError, match=r"before begin"):
        transport.send([("late", torch.ones(1))], 1)  # never written beside the published folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]


def test_an_old_version_that_cannot_be_removed_never_fails_a_sync(tmp_path, monkeypatch):
    """On a shared filesystem a server may still hold an old version's files (NFS then refuses the
    unlink): the new version is loaded all the same, and the old one goes at a later prune."""
    import errno
    import os

    engine = _Recorder(from_disk=True)
    transport = DiskTransport(engine, tmp_path, keep=1)
    _publish(transport, 1, [[("a", torch.ones(1))]])
    unlink = os.unlink

    def busy(path, *args, dir_fd=None, **kwargs):
        where = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path) if dir_fd is not None else str(path)
        if f"{os.sep}v000001{os.sep}" in where:
            raise OSError(errno.EBUSY, "Device or resource busy", where)
        return unlink(path, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(os, "unlink", busy)
    _publish(transport, 2, [[("a", torch.full((1,), 2.0))]])
    assert engine.calls[-1] == ("disk", tmp_path / "v000002", 2)
    assert (tmp_path / "v000001").is_dir()  # left for later
    monkeypatch.setattr(os, "unlink", unlink)
    _publish(transport, 3, [[("a", torch.full((1,), 3.0))]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003"]
