"""Apply a nested mapping (parsed YAML) onto typed config sections, checking every value against
its annotation; a ValueError names the dotted key."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting ints to floats; ValueError names `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner[:-1]:  # `bool | str`: the first type the value fits
            try:
                return coerce(value, option, key)
            except ValueError:
                pass
        return coerce(value, inner[-1], key)
    if tp is Any:
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"config key '{key}': expected a mapping with string keys, got {value!r}")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key '{key}': expected a list, got {value!r}")
        if dataclasses.is_dataclass(args[0]):  # a list of sections: keys read `eval.datasets[0].path`
            return [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
        return [coerce(v, args[0], key) for v in value]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"config key '{key}' is a section; expected a mapping, got {value!r}")
        section = tp()
        apply_mapping(section, value, f"{key}.")
        return section
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key '{key}': expected true/false, got {value!r}")
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    raise ValueError(f"config key '{key}': expected {getattr(tp, '__name__', tp)}, got {value!r}")


def apply_mapping(section: Any, updates: dict[str, Any], prefix: str) -> None:
    hints = typing.get_type_hints(type(section))
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in hints:
            known = ", ".join(sorted(hints))
            raise ValueError(f"unknown config key '{path}' (known in this section: {known})")
        current = getattr(section, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key '{path}' is a section; expected a mapping, got {value!r}")
            apply_mapping(current, value, f"{path}.")
        else:
            setattr(section, key, coerce(value, hints[key], path))


def apply_override(cfg: Any, key: str, value: Any) -> None:
    """Set the dotted `key` of `cfg` to `value` (checked as the file's values are).

    A part of the key that meets a list is an index into it: `eval.datasets.0.temperature`,
    `rollout.stop.1`; an index outside the list is refused (a whole list is set as `key=[...]`).
    Past the last section or list, the rest of the key nests as a mapping (as in a YAML file).
    """
    parts = key.split(".")
    node, hint, path = cfg, type(cfg), ""
    for i, part in enumerate(parts):
        if isinstance(node, list):
            index = _list_index(node, part, path)
            if i == len(parts) - 1:
                node[index] = coerce(value, _element_type(hint), f"{path}[{index}]")
                return
            node, hint, path = node[index], _element_type(hint), f"{path}[{index}]"
            continue
        rest = parts[i + 1:]
        child = getattr(node, part, None) if rest else None
        if not rest or not (dataclasses.is_dataclass(child) or isinstance(child, list)):
            apply_mapping(node, _nest(parts[i:], value), f"{path}." if path else "")
            return
        hint = typing.get_type_hints(type(node))[part]
        node, path = child, f"{path}.{part}" if path else part


def _list_index(items: list, part: str, path: str) -> int:
    if not part.isdigit():
        raise ValueError(f"config key '{path}.{part}': {path} is a list; expected an index 0..{len(items) - 1}")
    index = int(part)
    if index >= len(items):
        raise ValueError(f"config key '{path}.{part}': index {index} is out of range, {path} has {len(items)} "
                         f"item(s); set the whole list ({path}=[...]) to add items")
    return index


def _element_type(hint: Any) -> Any:
    """T of list[T] (or of list[T] | None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_args(hint)[0]


def _nest(parts: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(parts):
        out = {part: out}
    return out
