"""Read HF safetensors checkpoints (single file or sharded with an index), lazily, one tensor at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch

INDEX_FILE = "model.safetensors.index.json"


class HFCheckpoint:
    """The tensors of a HF checkpoint folder; only safetensors (never pickle) is read."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.path = Path(hf_dir)
        if not self.path.is_dir():
            raise ValueError(f"HF checkpoint folder not found: {self.path}")
        self._file_of = self._index()

    def _index(self) -> dict[str, Path]:
        """tensor name -> the shard file holding it."""
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.path / fname for name, fname in weight_map.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors file (or {INDEX_FILE}) in {self.path}")
        from safetensors import safe_open

        out = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                out.update({name: file for name in handle.keys()})
        return out

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for the given names (default: all), opening each shard file once."""
        from safetensors import safe_open

        wanted = self.names() if names is None else list(names)
        missing = [n for n in wanted if n not in self._file_of]
        if missing:
            raise ValueError(f"missing tensor(s) in {self.path}: {missing[:8]}")
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self._file_of[name], []).append(name)
        for file, file_names in by_file.items():
            if not file.is_file():
                raise ValueError(f"checkpoint shard listed in the index is missing: {file}")
            with safe_open(str(file), framework="pt") as handle:
                for name in file_names:
                    yield name, handle.get_tensor(name)
