"""Disk transport: each version becomes a safetensors folder, published atomically, then loaded.

Layout of `root/v000007/`: `model-00001.safetensors`, ... (one shard per bucket, in send order),
`model.safetensors.index.json` (weight_map + metadata.weight_version) and the template's
config/tokenizer files, so the folder is a loadable HF checkpoint. It is written under
`root/.v000007.tmp` and renamed when complete: a reader never sees a half-written version.

Loading: an engine with `update_weights_from_disk(path, version)` (SGLang: the
/update_weights_from_disk endpoint) loads the folder itself; any other engine (the embedded torch
engine) gets the shards replayed, in order, through the bucket protocol.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from megatron_rl.sync.buckets import NamedTensor
from megatron_rl.sync.transport import tensor_digest

INDEX = "model.safetensors.index.json"
TEMPLATE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.json", "merges.txt")


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


class DiskTransport:
    """Versioned safetensors snapshots (see the module docstring).

    Args:
        engine: the rollout engine to load into.
        root: shared folder (every server must read it).
        template_dir: HF folder whose config/tokenizer files are copied next to the shards.
        keep: published versions kept on disk (older ones are deleted after a successful load).
    """

    def __init__(self, engine, root: str | Path, template_dir: str | Path | None = None, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.engine = engine
        self.root = Path(root)
        self.template_dir = Path(template_dir) if template_dir else None
        self.keep = keep
        self._staging: Path | None = None
        self._weight_map: dict[str, str] = {}
        self._total_bytes = 0

    def begin(self, version: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._staging = self.root / f".v{version:06d}.tmp"
        shutil.rmtree(self._staging, ignore_errors=True)  # a crashed earlier attempt
        self._staging.mkdir()
        self._weight_map, self._total_bytes = {}, 0

    def send(self, bucket: list[NamedTensor], version: int) -> None:
        from safetensors.torch import save_file

        if self._staging is None:
            raise RuntimeError("DiskTransport.send() before begin()")
        shard = f"model-{len(set(self._weight_map.values())) + 1:05d}.safetensors"
        tensors = {name: t.detach().contiguous().cpu() for name, t in bucket}
        save_file(tensors, str(self._staging / shard), metadata={"weight_version": str(version)})
        for name, t in tensors.items():
            self._weight_map[name] = shard
            self._total_bytes += t.numel() * t.element_size()

    def finish(self, version: int) -> None:
        final = self._publish(version)
        if hasattr(self.engine, "update_weights_from_disk"):
            self.engine.update_weights_from_disk(final, version)
        else:
            replay_into(self.engine, final, version)
        self._prune(version)

    def _publish(self, version: int) -> Path:
        index = {"metadata": {"total_size": self._total_bytes, "weight_version": version},
                 "weight_map": self._weight_map}
        (self._staging / INDEX).write_text(json.dumps(index, indent=1))
        for name in TEMPLATE_FILES:
            if self.template_dir and (self.template_dir / name).is_file():
                shutil.copy2(self.template_dir / name, self._staging / name)
        final = version_dir(self.root, version)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(self._staging, final)  # atomic on one filesystem
        self._staging = None
        return final

    def _prune(self, version: int) -> None:
        published = sorted(p for p in self.root.glob("v[0-9]*") if p.is_dir())
        for old in published[:-self.keep]:
            if old != version_dir(self.root, version):
                shutil.rmtree(old, ignore_errors=True)

    def checksums(self, names: list[str]) -> dict[str, str]:
        """What the engine holds when it can tell (torch engine), else what the published folder holds."""
        try:
            return self.engine.checksum(names)
        except NotImplementedError:
            return read_digests(version_dir(self.root, self.engine.weight_version), names)


def iter_shards(folder: Path):
    """Yield each shard of a published version as a list of (name, tensor), in shard order."""
    from safetensors.torch import load_file

    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):
        yield list(load_file(str(folder / shard)).items())


def replay_into(engine, folder: Path, version: int) -> None:
    """Load a published version into an engine that only speaks the bucket protocol."""
    engine.pause()
    for bucket in iter_shards(folder):
        engine.update_weights(bucket, version)
    engine.finish_update(version)
    engine.resume()


def read_digests(folder: Path, names: list[str]) -> dict[str, str]:
    found = {n: t for bucket in iter_shards(folder) for n, t in bucket}
    return {n: tensor_digest(found[n]) for n in names if n in found}
