"""Loading a run configuration: a YAML recipe, then `section.key=value` overrides, then validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.apply import apply_mapping
from megatron_rl.config.run import RunConfig
from megatron_rl.config.validate import validate


def parse_override(text: str) -> tuple[str, Any]:
    """Parse `section.key=value` (value in YAML syntax) into (dotted key, value)."""
    if "=" not in text:
        raise ValueError(f"override '{text}': expected section.key=value")
    key, raw = text.split("=", 1)
    if "." not in key:
        raise ValueError(f"override '{text}': expected section.key=value")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def _nest(key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build a RunConfig from a YAML file (optional) and `section.key=value` overrides, validated."""
    cfg = RunConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file not found: {path}")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path}: expected a mapping at the top level")
        apply_mapping(cfg, data, "")
    for text in overrides:
        key, value = parse_override(text)
        apply_mapping(cfg, _nest(key, value), "")
    return validate(cfg)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
