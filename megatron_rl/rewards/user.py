"""User reward functions by import path (`pkg.module:fn` or `path/to/file.py:fn`), signature-checked."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable


def is_import_path(name: str) -> bool:
    """A reward spec naming a user function ("module:fn" or "file.py:fn") rather than a built-in."""
    return ":" in name


def load_user_fn(spec: str) -> Callable:
    """The callable named by `spec`; ValueError naming the spec when it cannot be imported.

    `path/to/file.py:fn` is loaded from the file (relative paths from the working directory) under
    a module name derived from its absolute path, so every rank and the reward worker import it the
    same way without touching sys.path; `pkg.module:fn` is imported as usual.
    """
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"reward {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    module = _load_file(target, spec) if target.endswith(".py") else _import_module(target, spec)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward {spec!r}: {target} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is not callable")
    return fn


def _import_module(name: str, spec: str):
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(f"reward {spec!r}: cannot import module {name!r}: {err}") from None


def _load_file(path: str, spec: str):
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"reward {spec!r}: no such file {path}")
    name = "megatron_rl_user_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"reward {spec!r}: importing {path} failed: {type(err).__name__}: {err}") from None
    return module


def check_signature(fn: Callable, spec: str, batched: bool) -> None:
    """ValueError unless `fn` takes (response, answer) positionally (lists of them when batched) and
    every other parameter it requires can be passed by keyword: a dataset column or `prompt`
    (`def score(response, answer, data_source)`; a row without the column is a counted error)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables: nothing to check before the first call
    try:
        bound = signature.bind_partial("response", "answer")
        if len(bound.arguments) < 2:
            raise TypeError("it takes fewer than two positional arguments")
        by_position = [p.name for p in signature.parameters.values() if p.name not in bound.arguments
                       and p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
        if by_position:
            raise TypeError(f"required positional-only {by_position}")
    except TypeError as err:
        shape = "(responses, answers, **extra) -> list" if batched else "(response, answer, **extra) -> float | dict"
        raise ValueError(f"reward {spec!r}: a reward takes {shape}; {fn.__name__}{signature} does not ({err})") from None


def accepted_extras(fn: Callable) -> frozenset[str] | None:
    """Names of the keyword arguments `fn` takes beyond the first two; None when it takes **kwargs
    (then every extra column of the row is passed)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = positional[2:] + [p for p in params if p.kind is p.KEYWORD_ONLY]
    return frozenset(p.name for p in named if p.kind is not p.POSITIONAL_ONLY)
