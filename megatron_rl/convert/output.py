"""What every conversion shares: atomic output folders, HF side files, progress bars, the summary."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

# Files of an HF folder that are weights (never copied as side files).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields a hidden sibling folder to write into; publishes it as `out_dir` only on success.

    A failure or a kill leaves no folder named `out_dir` (only a `.NAME.partial-PID` folder, which
    is removed on a clean failure). Raises ValueError if `out_dir` exists, is not empty and
    `overwrite` is False. With `overwrite`, the old folder is swapped out, then deleted.
    """
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output folder {out} exists and is not empty; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_tree(tmp)  # data on disk before the rename makes the folder look complete
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then the folders (cheap for files already synced)."""
    for path in [*sorted(folder.rglob("*"), key=lambda p: -len(p.parts)), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def side_files(src_dir: str | Path) -> list[Path]:
    """Top-level non-weight files of an HF folder (config, tokenizer, generation config, README)."""
    src = Path(src_dir)
    return sorted(p for p in src.iterdir() if p.is_file() and p.name not in WEIGHT_INDEXES
                  and not p.name.endswith(WEIGHT_SUFFIXES) and not p.name.startswith("."))


def copy_side_files(src_dir: str | Path, dst_dir: str | Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy `side_files(src_dir)` except the names in `skip`; returns the names copied."""
    copied = []
    for path in side_files(src_dir):
        if path.name not in skip:
            shutil.copy2(path, Path(dst_dir) / path.name)
            copied.append(path.name)
    return copied


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def progress_bar(total_bytes: int, desc: str, enabled: bool = True):
    """A tqdm byte counter on stderr (a no-op object when disabled)."""
    from tqdm import tqdm

    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, dynamic_ncols=True)


@dataclass
class Summary:
    """What a conversion did, printed at the end of every tool."""

    kind: str
    out_dir: str
    num_tensors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    details: dict[str, object] = field(default_factory=dict)
    _start: float = field(default_factory=time.perf_counter, repr=False)

    def finish(self) -> "Summary":
        self.seconds = time.perf_counter() - self._start
        self.peak_rss_bytes = peak_rss_bytes()
        return self

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / max(self.seconds, 1e-9) / 1e9

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "out_dir": self.out_dir, "num_tensors": self.num_tensors,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "seconds": round(self.seconds, 3), "gb_per_s": round(self.gb_per_s, 4),
                "peak_rss_bytes": self.peak_rss_bytes, **self.details}

    def format(self) -> str:
        lines = [f"{self.kind}: done -> {self.out_dir}",
                 f"  tensors written   {self.num_tensors}",
                 f"  bytes read        {_gib(self.bytes_read)}",
                 f"  bytes written     {_gib(self.bytes_written)}",
                 f"  time              {self.seconds:.1f} s ({self.gb_per_s:.3f} GB/s written)",
                 f"  peak RSS          {_gib(self.peak_rss_bytes)} (whole process)"]
        lines += [f"  {key:<17} {value}" for key, value in self.details.items()]
        return "\n".join(lines)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"
