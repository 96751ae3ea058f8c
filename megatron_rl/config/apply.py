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
        return coerce(value, inner[0], key)
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
