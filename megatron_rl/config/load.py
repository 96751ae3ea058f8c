"""Loading a run configuration: a YAML recipe, then `section.key=value` overrides, then validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.apply import apply_mapping, apply_override
from megatron_rl.config.recipe import read_recipe
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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build a RunConfig from a YAML recipe (optional; its `base:` chain merged in, recipe.py) and
    `section.key=value` overrides (list items by index: `eval.datasets.0.temperature=0.6`), validated."""
    cfg = RunConfig()
    if path is not None:
        apply_mapping(cfg, read_recipe(path), "")
    for text in overrides:
        apply_override(cfg, *parse_override(text))
    return validate(cfg)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML, every field with its value (defaults included), in RunConfig's
    order; load_config reads it back to an equal RunConfig."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(dump_config(cfg))
