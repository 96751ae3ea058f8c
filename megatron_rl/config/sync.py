"""The `sync` section: weight sync from the trainer into the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncConfig:
    bucket_size_mb: float = 512.0
    check: bool = False
    """Compare checksums of what the engine holds with what was sent, after every sync."""


CHOICES: dict[str, tuple] = {}
POSITIVE = ("bucket_size_mb",)
