"""Reading a YAML recipe and the chain of recipes it is based on (`base:`), merged into one mapping.

A recipe may name `base: <path>` (relative to the recipe's own folder); its keys override the base's.
Mappings merge key by key at every depth (a section, rollout.sglang, data.template_kwargs); any other
value, lists included (eval.datasets, rollout.stop), replaces the base's as a whole; `null` replaces too.
A base may itself name a base; a chain that comes back to a recipe is refused, naming the chain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

BASE_KEY = "base"


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe at `path` with its base chain merged in (no `base` key left)."""
    return _read(Path(path), ())


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A new mapping: `base` with `over`'s keys laid on top (mappings merged, other values replaced)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        names = " -> ".join(str(p) for p in (*chain, resolved))
        raise ValueError(f"config file {chain[-1]}: `base:` chain comes back to a recipe: {names}")
    if not path.is_file():
        where = f" (the base of {chain[-1]})" if chain else ""
        raise ValueError(f"config file not found: {path}{where}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping at the top level")
    if BASE_KEY not in data:
        return data
    base = data.pop(BASE_KEY)
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f"config file {path}: `base:` must be the path of a recipe (relative to {path.parent}), "
                         f"got {base!r}")
    return deep_merge(_read(path.parent / base, (*chain, resolved)), data)
