"""Write and read Megatron-Core torch_dist checkpoints with torch.distributed.checkpoint alone.

A torch_dist folder is a torch.distributed.checkpoint (DCP) folder (`.metadata` + `__R_F.distcp`
data files) keyed by Megatron's ShardedTensor keys at GLOBAL shapes, plus Megatron's
`metadata.json` (backend name and version) and `common.pt` (the non-sharded part of the state
dict; `content_metadata` is Megatron's slot for framework metadata). Neither side needs Megatron,
a GPU or a process group: DCP runs with `no_dist=True` in this one process.

Streaming: the writer plans every chunk up front from shapes alone and produces each chunk's data
only when DCP asks for it (`resolve_data`), in plan order (one file, one writer thread). The reader
loads boxes (sub-blocks of global tensors), e.g. one layer of a stacked [num_layers, ...] tensor.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_rl.convert.mcore_layout import Box

MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}
CONTENT_METADATA_KEY = "content_metadata"
# DCP warns that it runs in one process; that is the intent here.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
Resolver = Callable[[WriteItem], "torch.Tensor | io.BytesIO"]


@contextlib.contextmanager
def _plain_dcp_errors() -> Iterator[None]:
    """Silence DCP's one-process warning; re-raise the error DCP wraps in CheckpointException
    (a BaseException carrying each rank's failure) as itself, so a ValueError stays one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        try:
            yield
        except CheckpointException as err:
            failures = [failure[0] for failure in err.failures.values()]
            if failures and isinstance(failures[0], Exception):
                raise failures[0] from None
            raise


def tensor_item(key: str, box: Box, global_shape: tuple[int, ...], dtype: torch.dtype) -> WriteItem:
    """A DCP write request for one chunk (box in global coordinates) of a global tensor."""
    offsets, sizes = (torch.Size(v) for v in box)
    return WriteItem(
        index=MetadataIndex(fqn=key, offset=offsets), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                    properties=TensorProperties(dtype=dtype),
                                    size=torch.Size(global_shape)))


def bytes_item(key: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn=key), type=WriteItemType.BYTE_IO)


class _LazySavePlanner(DefaultSavePlanner):
    """Saves a fixed list of write items; data comes from `resolve(item)` when DCP writes it.

    DefaultSavePlanner's global plan turns the items into the checkpoint metadata and checks that
    every tensor's chunks tile its global shape exactly (no gap, no overlap).
    """

    def __init__(self, items: list[WriteItem], resolve: Resolver) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._resolve = items, resolve

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(items=list(self._items))
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self._resolve(write_item)


def write_torch_dist(out_dir: Path, items: list[WriteItem], resolve: Resolver,
                     content_metadata: dict) -> None:
    """Write a complete torch_dist folder (data, .metadata, common.pt, metadata.json).

    One writer thread and one data file: items are resolved one at a time in list order.
    Note: DCP's writer keeps the last chunk written per key alive until the file is closed, so
    the resident set holds about one chunk per distinct key (a layer's worth), not the model.
    """
    writer = FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=1, sync_files=True)
    with _plain_dcp_errors():
        dcp.save({}, storage_writer=writer, planner=_LazySavePlanner(items, resolve), no_dist=True)
    torch.save({CONTENT_METADATA_KEY: content_metadata}, out_dir / "common.pt")
    # metadata.json last: Megatron treats a folder without it as not a distributed checkpoint.
    (out_dir / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))


class _CachedReader(FileSystemReader):
    """Unpickles `.metadata` once instead of on every load call."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Loads boxes of global tensors into caller-provided tensors shaped like the boxes."""

    def __init__(self, boxes: dict[str, Box], targets: dict[str, torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._boxes, self._targets = boxes, targets

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, (offsets, sizes) in self._boxes.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets[read_item.dest_index.fqn]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target


class TorchDistReader:
    """Tensor keys, shapes and boxes of a torch_dist folder (no Megatron, no process group)."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.dir = Path(ckpt_dir)
        self._reader = _CachedReader(self.dir)
        metadata = self._reader.read_metadata()
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.num_objects = len(metadata.state_dict_metadata) - len(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.size) for k, v in self.tensors.items()}

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, boxes: dict[str, Box]) -> dict[str, torch.Tensor]:
        """{key: tensor shaped like its box}, in the stored dtype, with one DCP load call."""
        targets = {k: torch.empty(box[1], dtype=self.dtype(k)) for k, box in boxes.items()}
        with _plain_dcp_errors():
            dcp.load(dict(targets), storage_reader=self._reader,
                     planner=_BoxLoadPlanner(boxes, targets), no_dist=True)
        return targets


def read_content_metadata(ckpt_dir: Path) -> dict:
    """Megatron's `content_metadata` from common.pt ({} when absent or not plain data)."""
    path = Path(ckpt_dir) / "common.pt"
    if not path.is_file():
        return {}
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # not plain data (weights_only refuses it): nothing for us there
        return {}
    found = common.get(CONTENT_METADATA_KEY) if isinstance(common, dict) else None
    return found if isinstance(found, dict) else {}


def find_torch_dist_dir(path: str | Path) -> Path:
    """The torch_dist folder behind a user path.

    Accepts the folder itself, a trainer step folder holding `model/`, or a checkpoints root
    holding a `latest` file (newest step). Raises ValueError otherwise, or for another backend.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint folder not found: {path}")
    if (path / "latest").is_file() and not (path / "metadata.json").is_file():
        step = int((path / "latest").read_text().strip())
        return find_torch_dist_dir(path / f"step_{step:06d}")
    for candidate in (path, path / "model"):
        config = candidate / "metadata.json"
        if config.is_file():
            backend = json.loads(config.read_text()).get("sharded_backend")
            if backend != "torch_dist":
                raise ValueError(f"{candidate} uses sharded_backend={backend!r}; only torch_dist is supported")
            if not (candidate / ".metadata").is_file():
                raise ValueError(f"{candidate} has metadata.json but no .metadata: incomplete checkpoint?")
            return candidate
    raise ValueError(f"{path} is not a Megatron torch_dist checkpoint: no metadata.json (expected the "
                     "checkpoint folder, a step_NNNNNN folder with model/, or a root with 'latest')")


def chunk_items(key: str, boxes: Iterable[Box], global_shape: tuple[int, ...],
                dtype: torch.dtype) -> list[WriteItem]:
    return [tensor_item(key, box, global_shape, dtype) for box in boxes]
