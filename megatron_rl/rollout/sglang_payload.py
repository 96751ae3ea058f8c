"""SGLang's weight-update wire formats: flattened buckets for update_weights_from_tensor / _distributed.

A flattened bucket is one uint8 tensor holding every tensor's bytes back to back, plus per-tensor
metadata (name, shape, dtype, start_idx, end_idx, numel in bytes). SGLang rebuilds the tensors as
views of that buffer (`FlattenedTensorBucket.reconstruct_tensors`).

Ordering invariant: a receiver of update_weights_from_distributed allocates the buffer itself from
(names, dtypes, shapes) with offsets that are the plain running byte sum, and refuses a tensor whose
offset is not a multiple of its element size. Tensors are therefore laid out by element size,
largest first (float32 scales, then bf16, then fp8): every prefix then ends on a multiple of the
next element size, so no padding is needed and both sides compute the same offsets.
"""

from __future__ import annotations

import base64
import io
import types
from multiprocessing.reduction import ForkingPickler

import torch

NamedTensor = tuple[str, torch.Tensor]
LOAD_FORMAT = "flattened_bucket"


def order_for_flattening(bucket: list[NamedTensor]) -> list[NamedTensor]:
    """Stable sort by element size, largest first (see the module docstring)."""
    return sorted(bucket, key=lambda nt: -nt[1].element_size())


def flatten_bucket(bucket: list[NamedTensor]) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """A NEW uint8 buffer with the bucket's bytes, and its metadata, in `order_for_flattening` order.

    The buffer is freshly allocated on every call and must never be reused for a later bucket:
    SGLang returns from update_weights_from_tensor once its copies are enqueued, not finished, so
    overwriting the buffer can race with the consumer's copy (slime hit this as corrupted weights).
    """
    if not bucket:
        raise ValueError("cannot flatten an empty bucket")
    parts, metadata, offset = [], [], 0
    for name, tensor in order_for_flattening(bucket):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                              start_idx=offset, end_idx=offset + raw.numel(),
                                              numel=raw.numel()))
        parts.append(raw)
        offset += raw.numel()
    return torch.cat(parts), metadata


def unflatten_bucket(flat: torch.Tensor, metadata) -> list[NamedTensor]:
    """Views of `flat` per metadata entry (what SGLang's reconstruct_tensors returns)."""
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


def distributed_spec(bucket: list[NamedTensor]) -> dict[str, list]:
    """names / dtypes / shapes of update_weights_from_distributed, in flattening order."""
    ordered = order_for_flattening(bucket)
    return {"names": [n for n, _ in ordered],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in ordered],
            "shapes": [list(t.shape) for _, t in ordered]}


def serialize_flattened(flat: torch.Tensor, metadata) -> str:
    """base64 of the ForkingPickler dump of {"flattened_tensor", "metadata"}, as SGLang's HTTP
    endpoint takes it. Only globals on SGLang's SafeUnpickler allow-list appear in the pickle:
    torch rebuild functions, torch.Size / dtypes and types.SimpleNamespace for the metadata.

    CUDA tensors travel as IPC handles (call `_sglang.patch_cuda_ipc_reductions()` first); CPU
    tensors as shared-memory files, which needs torch's "file_system" sharing strategy because a
    file descriptor cannot travel inside an HTTP body.
    """
    if not flat.is_cuda:
        torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode()


def kv_scale_tensors(scales: list[tuple[float, float]], device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """(k_scale, v_scale) per layer -> float32 scalars under the names SGLang's loader maps onto each
    attention's parameters (model_loader/weight_utils.py:1816-1844, maybe_remap_kv_scale_name:
    `model.layers.i.self_attn.k_scale` -> `model.layers.i.self_attn.attn.k_scale`)."""
    out = []
    for i, (k, v) in enumerate(scales):
        out += [(f"model.layers.{i}.self_attn.{leaf}", torch.tensor(float(x), dtype=torch.float32, device=device))
                for leaf, x in (("k_scale", k), ("v_scale", v))]
    return out

