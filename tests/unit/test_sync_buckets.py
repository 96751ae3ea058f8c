"""Bucket planning and ordering of the weight stream; tensor digests."""

import pytest
import torch

from megatron_rl.sync.buckets import iter_buckets
from megatron_rl.sync.transport import tensor_digest


def _named(sizes):
    return [(f"t{i}.weight", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]


def test_buckets_respect_the_byte_budget_and_keep_order():
    named = _named([10, 10, 10, 30, 5])  # 40, 40, 40, 120, 20 bytes
    buckets = list(iter_buckets(iter(named), bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [
        ["t0.weight", "t1.weight"], ["t2.weight"], ["t3.weight"], ["t4.weight"]]
    # the 120-byte tensor exceeds the bucket and travels alone
    assert sum(len(b) for b in buckets) == len(named)


def test_scale_never_opens_a_new_bucket():
    named = [("a.weight", torch.zeros(16, dtype=torch.float8_e4m3fn)),
             ("a.weight_scale_inv", torch.zeros(4, dtype=torch.float32)),
             ("b.weight", torch.zeros(16, dtype=torch.float8_e4m3fn))]
    buckets = list(iter_buckets(iter(named), bucket_bytes=16))
    assert [[n for n, _ in b] for b in buckets] == [["a.weight", "a.weight_scale_inv"], ["b.weight"]]


def test_every_bucket_after_the_first_gets_the_whole_budget():
    named = _named([10, 10, 10, 10, 10, 10])  # 40 bytes each: exactly two per 80-byte bucket
    buckets = list(iter_buckets(iter(named), bucket_bytes=80))
    assert [len(b) for b in buckets] == [2, 2, 2]


def test_a_per_tensor_scale_stays_with_its_weight():
    named = [("a.weight", torch.zeros(16, dtype=torch.float8_e4m3fn)),
             ("a.weight_scale", torch.ones((), dtype=torch.float32)),  # tensorwise FP8: one scalar
             ("b.weight", torch.zeros(16, dtype=torch.float8_e4m3fn))]
    buckets = list(iter_buckets(iter(named), bucket_bytes=16))
    assert [[n for n, _ in b] for b in buckets] == [["a.weight", "a.weight_scale"], ["b.weight"]]


def test_the_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket size must be > 0 bytes, got 0"):
        list(iter_buckets(iter(_named([1])), bucket_bytes=0))
    assert [len(b) for b in iter_buckets(iter(_named([1, 1])), bucket_bytes=1)] == [1, 1]  # 1 byte: one each


def test_buckets_are_lazy():
    consumed = []

    def stream():
        for i in range(4):
            consumed.append(i)
            yield f"t{i}.weight", torch.zeros(10)

    it = iter_buckets(stream(), bucket_bytes=40)
    first = next(it)
    assert [n for n, _ in first] == ["t0.weight"]
    assert consumed == [0, 1]  # only one tensor read ahead: peak memory ~ one bucket


def test_digest_sees_bytes_dtype_and_shape():
    a = torch.arange(6, dtype=torch.float32)
    assert tensor_digest(a) == tensor_digest(a.clone())
    b = a.clone()
    b[3] = 3.0000002
    assert tensor_digest(a) != tensor_digest(b)
    assert tensor_digest(a) != tensor_digest(a.view(2, 3))
    assert tensor_digest(a.to(torch.float8_e4m3fn)) != tensor_digest(a.to(torch.float8_e5m2))


def test_digest_of_a_scalar_scale():
    scale = torch.tensor(0.5, dtype=torch.float32)  # fp8_tensorwise ships a 0-d weight_scale
    assert tensor_digest(scale) != tensor_digest(torch.tensor(0.25))
