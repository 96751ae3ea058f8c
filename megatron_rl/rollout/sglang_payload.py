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
import copyreg
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

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

    CUDA tensors travel as IPC handles whose device is named by UUID (`SGLangIpcPickler`); CPU
    tensors as shared-memory files, which needs torch's "file_system" sharing strategy because a
    file descriptor cannot travel inside an HTTP body.
    """
    buf = io.BytesIO()
    if _is_cuda(flat):
        SGLangIpcPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    else:
        torch.multiprocessing.set_sharing_strategy("file_system")
        ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode()


# SGLang rebuilds an IPC tensor with its own function, which maps the device from the GPU's UUID
# (srt/utils/patch_torch.py _rebuild_cuda_tensor_modified / _device_from_maybe_uuid; the name is on
# SafeUnpickler's allow-list, srt/utils/common.py): the sender's device index means nothing under
# the server's CUDA_VISIBLE_DEVICES. sglang's monkey_patch_torch_reductions makes torch's
# reduce_tensor write that function and the UUID in argument 6 (_REDUCE_TENSOR_ARG_DEVICE_INDEX);
# the pickler below writes the same bytes for one payload, with neither sglang importable in the
# trainer (a server_command runs SGLang in another environment) nor torch patched globally.
SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
DEVICE_ARG = 6


class _SGLangRebuild:
    """Stands for SGLANG_CUDA_REBUILD in a reduction; pickled as that global name only (callable
    because pickle requires a reduction's function to be; it runs only in SGLang)."""

    def __call__(self, *args):
        raise RuntimeError("SGLang's CUDA rebuild runs in the server, never in the trainer")


_SGLANG_REBUILD = _SGLangRebuild()


def _is_cuda(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda


def _torch_reduce(tensor: torch.Tensor):
    """torch's own reduce_tensor (the one before sglang's patch, if sglang patched this process)."""
    return getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)(tensor)


def _device_uuid(device) -> str:
    """What sglang's _device_to_uuid writes (patch_torch.py): the GPU's UUID, as a string."""
    return device if isinstance(device, str) else str(torch.cuda.get_device_properties(device).uuid)


class SGLangIpcPickler(pickle._Pickler):
    """ForkingPickler's reductions (torch's storages, file descriptors), with CUDA tensors reduced
    the way SGLang's unpickler rebuilds them (see SGLANG_CUDA_REBUILD). The Python pickler: only it
    lets save_global be overridden, and a payload is a few handles and the metadata."""

    def __init__(self, file):
        super().__init__(file)
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)

    def reducer_override(self, obj):
        if obj is _SGLANG_REBUILD:
            return SGLANG_CUDA_REBUILD[1]  # a name: pickle calls save_global below
        if isinstance(obj, torch.Tensor) and _is_cuda(obj):
            fn, args = _torch_reduce(obj)
            if fn in (reductions.rebuild_cuda_tensor, getattr(reductions, "_rebuild_cuda_tensor_original", None)):
                return _SGLANG_REBUILD, (*args[:DEVICE_ARG], _device_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1:])
            return fn, args
        return NotImplemented

    def save_global(self, obj, name=None):
        if obj is not _SGLANG_REBUILD:
            return super().save_global(obj, name)
        module, qualname = SGLANG_CUDA_REBUILD
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


def kv_scale_tensors(scales: list[tuple[float, float]], device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """(k_scale, v_scale) per layer -> float32 scalars under the names SGLang's loader maps onto each
    attention's parameters (model_loader/weight_utils.py:1816-1844, maybe_remap_kv_scale_name:
    `model.layers.i.self_attn.k_scale` -> `model.layers.i.self_attn.attn.k_scale`)."""
    out = []
    for i, (k, v) in enumerate(scales):
        out += [(f"model.layers.{i}.self_attn.{leaf}", torch.tensor(float(x), dtype=torch.float32, device=device))
                for leaf, x in (("k_scale", k), ("v_scale", v))]
    return out

