"""SGLang's HTTP protocol read from the installed sglang package's source (test helper).

The sglang package is installed with --no-deps on CPU machines: its server modules do not import
there (they need triton and CUDA), so routes, request schemas, sampling-param names, server
arguments and the unpickler allow-list are taken from its source with `ast`, never imported.
A renamed or removed field in SGLang then changes what the conformance server accepts.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any


def sglang_root() -> Path | None:
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    return Path(spec.submodule_search_locations[0]) if spec else None


def _tree(rel: str) -> ast.Module:
    return ast.parse((sglang_root() / rel).read_text())


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


@lru_cache(None)
def route_table() -> dict[str, dict[str, Any]]:
    """{path: {"methods", "request_class", "auth_level"}} of sglang's http_server.py."""
    routes = {}
    for fn in _tree("srt/entrypoints/http_server.py").body:
        if not isinstance(fn, ast.AsyncFunctionDef):
            continue
        level = "normal"
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "auth_level":
                level = ast.unparse(dec.args[0]).split(".")[-1].lower()
        for dec in fn.decorator_list:
            path_methods = _route_of(dec)
            if path_methods:
                path, methods = path_methods
                routes[path] = {"methods": methods, "request_class": _obj_class(fn), "auth_level": level}
    return routes


def _route_of(dec) -> tuple[str, list[str]] | None:
    if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
        return None
    if not (isinstance(dec.args[0], ast.Constant) if dec.args else False):
        return None
    verb = dec.func.attr
    if verb in ("get", "post"):
        return dec.args[0].value, [verb.upper()]
    if verb == "api_route":
        methods = next((ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods"), ["GET"])
        return dec.args[0].value, methods
    return None


def _obj_class(fn) -> str | None:
    """The request class of `obj: X` or `obj: Annotated[X, Body()]` (Optional[...] unwrapped)."""
    for arg in fn.args.args:
        if arg.arg == "obj" and arg.annotation is not None:
            text = ast.unparse(arg.annotation)
            for wrapper in ("Annotated[", "Optional["):
                if text.startswith(wrapper):
                    text = text[len(wrapper):].split(",")[0].rstrip("]")
            return text
    return None


@lru_cache(None)
def request_schema(class_name: str) -> dict[str, tuple[ast.expr, bool]]:
    """{field: (annotation, required)} of an io_struct request class, base classes included."""
    classes = _classes(_tree("srt/managers/io_struct.py"))
    fields: dict[str, tuple[ast.expr, bool]] = {}
    cls = classes[class_name]
    for base in cls.bases:
        name = ast.unparse(base)
        if name in classes:
            fields.update(request_schema(name))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = (stmt.annotation, stmt.value is None)
    return fields


@lru_cache(None)
def sampling_param_names() -> frozenset[str]:
    cls = _classes(_tree("srt/sampling/sampling_params.py"))["SamplingParams"]
    return frozenset(s.target.id for s in cls.body if isinstance(s, ast.AnnAssign))


@lru_cache(None)
def server_arg_names() -> frozenset[str]:
    """ServerArgs fields: in server_args.py (older sglang) and arg_groups/fields/*.py (newer)."""
    files = [sglang_root() / "srt/server_args.py", *sorted((sglang_root() / "srt/arg_groups/fields").glob("*.py"))]
    names = set()
    for path in files:
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef):
                names.update(s.target.id for s in cls.body
                             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return frozenset(names)


@lru_cache(None)
def unpickler_allowed_globals() -> frozenset[tuple[str, str]]:
    """SafeUnpickler.ALLOWED_GLOBALS of sglang.srt.utils.common (what update_weights_from_tensor accepts)."""
    for node in ast.walk(_tree("srt/utils/common.py")):
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and stmt.targets[0].id == "ALLOWED_GLOBALS":
                    return frozenset(ast.literal_eval(stmt.value))
    raise AssertionError("SafeUnpickler.ALLOWED_GLOBALS not found in sglang")


@lru_cache(None)
def auth_module():
    """sglang/srt/utils/auth.py loaded by path (pure Python; its package __init__ needs triton)."""
    spec = importlib.util.spec_from_file_location("sglang_auth_for_tests", sglang_root() / "srt/utils/auth.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_value(annotation: ast.expr, value: Any) -> bool:
    """Does a JSON value fit a typing annotation (as written in sglang's source)? Unknown names pass."""
    text = ast.unparse(annotation)
    if isinstance(annotation, ast.Subscript):
        head = ast.unparse(annotation.value).split(".")[-1]
        args = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        if head == "Optional":
            return value is None or check_value(args[0], value)
        if head == "Union":
            return any(check_value(a, value) for a in args)
        if head == "Annotated":
            return check_value(args[0], value)
        if head in ("List", "list", "Set", "set"):
            return isinstance(value, list) and all(check_value(args[0], v) for v in value)
        if head in ("Dict", "dict"):
            return isinstance(value, dict)
        if head == "Literal":
            return value in [ast.literal_eval(a) for a in args]
        return True
    simple = {"str": str, "int": int, "float": (int, float), "bool": bool, "bytes": str}
    if text in simple:
        return isinstance(value, simple[text]) and not (text in ("int", "float") and isinstance(value, bool))
    return True
