"""HF safetensors -> Megatron-Core torch_dist checkpoint (model weights only), streamed tensor by tensor.

The checkpoint is written by one process with the GLOBAL layout Megatron's own save produces (see
mcore_layout.py), chunked exactly as ranks of a TP=tp run would write it. torch_dist reshards on
load, so the folder loads at any TP/PP; `tp`/`pp` are validated against the model (Megatron's
divisibility rules) and recorded in `content_metadata`, and `tp` sets the on-disk chunking (each
rank of a TP=tp job then reads whole chunks). No Megatron import, no process group.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_rl.convert import mcore_layout as layout
from megatron_rl.convert.output import Summary, atomic_output_dir, copy_side_files, progress_bar
from megatron_rl.convert.safetensors_io import HFSafetensors
from megatron_rl.convert.torch_dist_io import bytes_item, chunk_items, write_torch_dist
from megatron_rl.models import name_map
from megatron_rl.models.hf_config import ModelSpec, transformer_config_kwargs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HF_SUBDIR = "hf"
"""Sub-folder of the output holding the HF config.json and tokenizer files (for the way back)."""
FORMAT_VERSION = 1


def check_hf_tensors(ckpt: HFSafetensors, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies is present with the implied shape; nothing unexpected.

    Returns the HF shapes. Raises ValueError naming missing, unexpected or mis-shaped tensors.
    """
    expected = layout.expected_hf_shapes(spec)
    names = set(ckpt.names())
    missing = sorted(set(expected) - names)
    if missing:
        raise ValueError(f"{len(missing)} tensor(s) missing from the HF checkpoint {ckpt.dir}, "
                         f"first: {missing[:5]}")
    unexpected = sorted(n for n in names - set(expected) if not _ignorable(n, spec))
    if unexpected:
        raise ValueError(f"{len(unexpected)} unexpected tensor(s) for a {spec.arch} model with "
                         f"{spec.num_layers} layers (config.json), first: {unexpected[:5]}")
    for name, shape in expected.items():
        found = ckpt.entry(name).shape
        if found != shape:
            raise ValueError(f"tensor {name!r} has shape {found}, config.json implies {shape}")
    return expected


def _ignorable(hf_name: str, spec: ModelSpec) -> bool:
    tied_head = spec.tie_word_embeddings and hf_name == "lm_head.weight"
    return tied_head or any(p.match(hf_name) for p in name_map.IGNORED_HF)


class _FullTensors:
    """Builds full Megatron tensors from HF tensors; keeps only the latest one (chunks of one
    tensor are consecutive in the plan, so each is built once)."""

    def __init__(self, ckpt: HFSafetensors, spec: ModelSpec, dtype: torch.dtype | None) -> None:
        self.ckpt, self.spec, self.dtype = ckpt, spec, dtype
        self._name: str | None = None
        self._full: torch.Tensor | None = None
        self.bytes_read = 0

    def get(self, megatron_name: str) -> torch.Tensor:
        if megatron_name != self._name:
            self._name, self._full = None, None  # release before building the next one
            sources = layout.hf_sources(megatron_name, self.spec)
            pieces = [self.ckpt.get(s) for s in sources]
            self.bytes_read += sum(p.numel() * p.element_size() for p in pieces)
            rule = name_map.match_megatron(megatron_name, self.spec)[0]
            full = rule.to_megatron(pieces, self.spec)
            self._full = full.to(self.dtype) if self.dtype is not None else full
            self._name = megatron_name
        assert self._full is not None
        return self._full


def _plan(tensors: list[layout.StoredTensor], tp: int, dtypes: dict[str, torch.dtype],
          spec: ModelSpec) -> tuple[list[WriteItem], dict]:
    """Write items in layer-major order plus {(key, global offsets): (tensor, full-space box)}."""
    items: list[WriteItem] = []
    slots: dict[tuple[str, tuple[int, ...]], tuple[layout.StoredTensor, layout.Box]] = {}
    for tensor in tensors:
        boxes = layout.tp_chunks(tensor, tp)
        global_boxes = [tensor.to_global(box) for box in boxes]
        items += chunk_items(tensor.key, global_boxes, tensor.global_shape, dtypes[tensor.megatron_name])
        for box, global_box in zip(boxes, global_boxes):
            slots[(tensor.key, tuple(global_box[0]))] = (tensor, box)
    items += [bytes_item(key) for key in layout.extra_state_keys(spec)]
    return items, slots


def _chunk(full: torch.Tensor, tensor: layout.StoredTensor, box: layout.Box) -> torch.Tensor:
    view = full
    for dim, (start, size) in enumerate(zip(*box)):
        view = view.narrow(dim, start, size)
    return view.unsqueeze(0) if tensor.layer is not None else view


def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1,
                           dtype: str | None = None, overwrite: bool = False,
                           progress: bool = True) -> Summary:
    """Convert an HF folder to a torch_dist folder `out_dir` (atomic); returns the summary.

    Args:
        tp, pp: tensor / pipeline parallel sizes to validate for (and chunk for, tp).
        dtype: "bf16" | "fp32" | None (keep each HF tensor's dtype).
    Raises ValueError for an unsupported architecture, TP/PP the model cannot take, missing,
    unexpected or mis-shaped tensors, or an existing non-empty `out_dir` without `overwrite`.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    spec = ModelSpec.from_hf_config(hf_dir)
    try:  # Megatron's divisibility rules (heads, KV heads, vocab, FFN, layers), named errors
        transformer_config_kwargs(spec, tp=tp, pp=pp)
    except ValueError as err:
        raise ValueError(f"tp={tp}, pp={pp} do not fit this model: {err}") from err
    ckpt = HFSafetensors(hf_dir)
    hf_shapes = check_hf_tensors(ckpt, spec)
    target = DTYPES[dtype] if dtype else None
    tensors = layout.stored_tensors(spec, hf_shapes)
    dtypes = {t.megatron_name: target or ckpt.entry(layout.hf_sources(t.megatron_name, spec)[0]).dtype
              for t in tensors}
    items, slots = _plan(tensors, tp, dtypes, spec)
    summary = Summary("convert_hf_to_megatron", str(Path(out_dir).absolute()))
    total = sum(math.prod(t.full_shape) * dtypes[t.megatron_name].itemsize for t in tensors)
    source = _FullTensors(ckpt, spec, target)
    extra_state = layout.empty_extra_state()
    with atomic_output_dir(out_dir, overwrite) as tmp, progress_bar(total, "hf->megatron", progress) as bar:

        def resolve(item: WriteItem):
            if item.type == WriteItemType.BYTE_IO:
                return io.BytesIO(extra_state)
            tensor, box = slots[(item.index.fqn, tuple(item.index.offset))]
            chunk = _chunk(source.get(tensor.megatron_name), tensor, box)
            bar.update(chunk.numel() * chunk.element_size())
            summary.bytes_written += chunk.numel() * chunk.element_size()
            return chunk

        write_torch_dist(tmp, items, resolve, _content_metadata(hf_dir, spec, tp, pp, dtype))
        (tmp / HF_SUBDIR).mkdir()
        copy_side_files(hf_dir, tmp / HF_SUBDIR)
    summary.bytes_read = source.bytes_read
    summary.num_tensors = len(tensors)
    summary.details.update({"tp x pp": f"{tp} x {pp}",
                            "dtype": dtype or "as in the HF files", "chunks": len(items)})
    return summary.finish()


def _content_metadata(hf_dir: str | Path, spec: ModelSpec, tp: int, pp: int, dtype: str | None) -> dict:
    """Recorded in common.pt (plain data only: torch.load(weights_only=True) reads it)."""
    return {"producer": "megatron_rl.convert.hf_to_megatron", "format_version": FORMAT_VERSION,
            "model_only": True, "arch": spec.arch,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "dtype": dtype or "source",
            "hf_config": json.loads((Path(hf_dir) / "config.json").read_text())}
