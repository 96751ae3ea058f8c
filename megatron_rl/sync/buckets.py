"""Streaming buckets of named tensors: peak extra memory is about one bucket, never a model copy."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(named: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group a stream of (name, tensor) into lists of at most `bucket_bytes` bytes each.

    Order is preserved. A tensor larger than a bucket travels alone; tensors that must arrive
    together (an FP8 weight and its `weight_scale_inv`) are yielded consecutively by the
    quantizer and kept in one bucket here: a scale never opens a new bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor_bytes(tensor)
        is_companion = name.endswith("_scale_inv") or name.endswith(".weight_scale")
        if bucket and size + nbytes > bucket_bytes and not is_companion:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
