"""Streaming safetensors I/O: a lazy reader of HF checkpoints and a planned, sharded writer.

Reading: every tensor comes from its own short-lived `safe_open`, so its pages are memory-mapped
only while the caller holds the tensor (one open handle for a whole shard keeps every page it
touched resident, measured: RSS grows to the shard size).

Writing: the set of tensors (names, shapes, dtypes) is planned up front, so every shard's header
is known before any data arrives; each tensor is then written straight to its planned byte range.
Peak memory is the tensor being written, whatever the shard size. File layout (safetensors spec):
8-byte little-endian header length, JSON header padded with spaces to a multiple of 8, then the
tensors' raw little-endian bytes back to back in header order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

import torch

INDEX_NAME = "model.safetensors.index.json"
DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """One planned tensor: HF name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class HFSafetensors:
    """The safetensors weights of an HF model folder, read one tensor at a time.

    Accepts a sharded checkpoint (model.safetensors.index.json) or one or more *.safetensors
    files. Raises ValueError for a missing folder, no safetensors files, or a file the index
    names that does not exist.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise ValueError(f"HF checkpoint folder not found: {self.dir}")
        self._file_of = _weight_map(self.dir)
        self._entries = _read_headers(self.dir, self._file_of)

    def names(self) -> list[str]:
        """Tensor names in file order (the order the checkpoint was written in)."""
        return list(self._entries)

    def entry(self, name: str) -> TensorEntry:
        if name not in self._entries:
            raise ValueError(f"tensor {name!r} is not in the HF checkpoint {self.dir}")
        return self._entries[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor, memory-mapped: its pages stay resident only while the caller holds it."""
        from safetensors import safe_open

        self.entry(name)
        with safe_open(self.dir / self._file_of[name], framework="pt") as handle:
            return handle.get_tensor(name)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())


def _weight_map(hf_dir: Path) -> dict[str, str]:
    index = hf_dir / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for file_name in sorted(set(weight_map.values())):
            if not (hf_dir / file_name).is_file():
                raise ValueError(f"{index} names {file_name}, which does not exist")
        return dict(weight_map)
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pt"))
        hint = f" (found {other[:3]}: re-save with safe_serialization=True)" if other else ""
        raise ValueError(f"no *.safetensors weights in {hf_dir}{hint}")
    return {name: file_name for file_name in files for name in _file_keys(hf_dir / file_name)}


def _file_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        return list(handle.keys())


def _read_headers(hf_dir: Path, file_of: dict[str, str]) -> dict[str, TensorEntry]:
    """Shapes and dtypes from the files' headers (no tensor data is read)."""
    from safetensors import safe_open

    entries: dict[str, TensorEntry] = {}
    by_file: dict[str, list[str]] = {}
    for name, file_name in file_of.items():
        by_file.setdefault(file_name, []).append(name)
    for file_name in sorted(by_file):
        with safe_open(hf_dir / file_name, framework="pt") as handle:
            present = set(handle.keys())
            for name in by_file[file_name]:
                if name not in present:
                    raise ValueError(f"the index maps {name!r} to {file_name}, which does not hold it")
                part = handle.get_slice(name)
                code = part.get_dtype()
                if code not in CODE_DTYPES:
                    raise ValueError(f"tensor {name!r} has unsupported dtype {code}")
                entries[name] = TensorEntry(name, tuple(part.get_shape()), CODE_DTYPES[code])
    return entries


def plan_shards(entries: Iterable[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Greedy split in order: a new shard starts when the next tensor would pass the limit.

    A tensor larger than the limit gets a shard of its own (tensors are never split).
    """
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards if shards[0] else []


class ShardedSafetensorsWriter:
    """Writes planned tensors into `model-0000i-of-0000n.safetensors` files plus the index json.

        writer = ShardedSafetensorsWriter(out_dir, entries, max_shard_bytes=2 * 2**30)
        for name, tensor in stream:            # any order; each planned name exactly once
            writer.write(name, tensor)
        writer.close()                         # checks completeness, writes the index

    Raises ValueError for an unplanned name, a second write, or a shape/dtype mismatch
    (naming the tensor), and at close for any planned tensor never written.
    """

    def __init__(self, out_dir: str | Path, entries: Iterable[TensorEntry], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None) -> None:
        self.dir = Path(out_dir)
        shards = plan_shards(entries, max_shard_bytes)
        self._slots: dict[str, tuple[TensorEntry, BinaryIO, int]] = {}
        self._files: list[BinaryIO] = []
        self.weight_map: dict[str, str] = {}
        self._written: set[str] = set()
        for i, shard in enumerate(shards):
            file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            self._open_shard(file_name, shard, {"format": "pt", **(metadata or {})})

    def _open_shard(self, file_name: str, shard: list[TensorEntry], metadata: dict[str, str]) -> None:
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for entry in shard:
            if entry.name in self.weight_map:
                raise ValueError(f"tensor {entry.name!r} is planned twice")
            header[entry.name] = {"dtype": DTYPE_CODES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + entry.nbytes]}
            offset += entry.nbytes
            self.weight_map[entry.name] = file_name
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        handle = open(self.dir / file_name, "w+b")
        handle.write(len(blob).to_bytes(8, "little") + blob)
        data_start = 8 + len(blob)
        handle.truncate(data_start + offset)
        self._files.append(handle)
        for entry in shard:
            start = header[entry.name]["data_offsets"][0]  # type: ignore[index]
            self._slots[entry.name] = (entry, handle, data_start + start)

    def __enter__(self) -> "ShardedSafetensorsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._files:
            handle.close()
        self._files = []

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._slots:
            raise ValueError(f"tensor {name!r} was not planned for this checkpoint")
        if name in self._written:
            raise ValueError(f"tensor {name!r} was written twice")
        entry, handle, offset = self._slots[name]
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ValueError(f"tensor {name!r}: got {tuple(tensor.shape)} {tensor.dtype}, "
                             f"expected {entry.shape} {entry.dtype}")
        if tensor.numel():
            # Raw bytes without a copy for contiguous CPU tensors (view as bytes, then numpy's buffer).
            raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            handle.seek(offset)
            handle.write(memoryview(raw))
        self._written.add(name)

    def close(self) -> int:
        """Flush and close the shards, write the index json; returns the total tensor bytes."""
        missing = [n for n in self._slots if n not in self._written]
        self.__exit__()
        if missing:
            raise ValueError(f"{len(missing)} planned tensor(s) never written, first: {missing[:5]}")
        total = sum(entry.nbytes for entry, _, _ in self._slots.values())
        index = {"metadata": {"total_size": total}, "weight_map": self.weight_map}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return total
