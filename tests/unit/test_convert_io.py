"""The streaming safetensors writer, size parsing and the per-TP chunk boxes, in isolation."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open

from megatron_rl.convert.cli import parse_size
from megatron_rl.convert.mcore_layout import StoredTensor, tp_chunks
from megatron_rl.convert.safetensors_io import ShardedSafetensorsWriter, TensorEntry

TENSORS = {
    "a": torch.randn(3, 5),
    "b": torch.randn(7).to(torch.bfloat16),
    "c": torch.randn(4, 4).to(torch.float8_e4m3fn),
    "empty": torch.zeros(0, 3),
    "scalar": torch.tensor(2.5),
    "ids": torch.arange(6, dtype=torch.int64),
}


def entries() -> list[TensorEntry]:
    return [TensorEntry(name, tuple(t.shape), t.dtype) for name, t in TENSORS.items()]


def test_writer_any_order_is_readable_by_safetensors(tmp_path):
    with ShardedSafetensorsWriter(tmp_path, entries(), max_shard_bytes=64) as writer:
        for name in reversed(list(TENSORS)):
            writer.write(name, TENSORS[name])
        total = writer.close()
    assert total == sum(t.numel() * t.element_size() for t in TENSORS.values())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 3 and files[0] == "model-00001-of-00003.safetensors"
    for name, tensor in TENSORS.items():
        with safe_open(tmp_path / index["weight_map"][name], framework="pt") as handle:
            got = handle.get_tensor(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                           tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor), name


def test_writer_rejects_bad_writes(tmp_path):
    with ShardedSafetensorsWriter(tmp_path, entries(), max_shard_bytes=10**6) as writer:
        with pytest.raises(ValueError, match="'zzz' was not planned"):
            writer.write("zzz", torch.zeros(1))
        with pytest.raises(ValueError, match="tensor 'a': got \\(5, 3\\)"):
            writer.write("a", torch.zeros(5, 3))
        with pytest.raises(ValueError, match="tensor 'b': got .*torch.float32"):
            writer.write("b", torch.zeros(7))
        writer.write("a", TENSORS["a"])
        with pytest.raises(ValueError, match="'a' was written twice"):
            writer.write("a", TENSORS["a"])
        with pytest.raises(ValueError, match="5 planned tensor\\(s\\) never written"):
            writer.close()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512MiB") == 2**29
    assert parse_size("1.5kb") == 1500
    assert parse_size("4096") == 4096
    for bad in ("0GB", "lots", "5 parsecs"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_tp_chunks_cover_each_rank_shard():
    """Boxes a TP=2 rank owns: column rows, row columns, gate_up per-rank halves of gate and up."""
    qkv = StoredTensor("decoder.layers.0.self_attention.linear_qkv.weight", "k", 0, (8, 4), 2)
    assert tp_chunks(qkv, 2) == [((0, 0), (4, 4)), ((4, 0), (4, 4))]
    proj = StoredTensor("decoder.layers.0.self_attention.linear_proj.weight", "k", 0, (4, 6), 2)
    assert tp_chunks(proj, 2) == [((0, 0), (4, 3)), ((0, 3), (4, 3))]
    fc1 = StoredTensor("decoder.layers.0.mlp.linear_fc1.weight", "k", 0, (8, 4), 2)
    # full = [gate (4 rows); up (4 rows)]: rank 0 gate rows 0-1 and up rows 4-5, rank 1 the rest.
    assert tp_chunks(fc1, 2) == [((0, 0), (2, 4)), ((4, 0), (2, 4)), ((2, 0), (2, 4)), ((6, 0), (2, 4))]
    norm = StoredTensor("decoder.final_layernorm.weight", "k", None, (4,), 2)
    assert tp_chunks(norm, 2) == [((0,), (4,))]
    with pytest.raises(ValueError, match="not divisible by tp=4"):
        tp_chunks(proj, 4)
