"""The one seam to the sglang package: everything that needs it imports it here, lazily."""

from __future__ import annotations

import importlib.util
import sys

SERVER_MODULE = "sglang.launch_server"
ROUTER_MODULE = "sglang_router.launch_router"


def require_module(name: str, install_hint: str) -> None:
    """Raise a clear error at build time when `name` (sglang, sglang_router) is not installed."""
    if importlib.util.find_spec(name.split(".")[0]) is None:
        raise RuntimeError(f"rollout.engine=sglang needs the {name.split('.')[0]!r} package on this "
                           f"machine: {install_hint}")


def sglang_import_error() -> str | None:
    """Why SGLang's server arguments do not import in this interpreter (None when they do)."""
    try:
        import sglang.srt.server_args  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure (missing deps, CUDA libs) is the answer
        return f"{type(err).__name__}: {err}"
    return None


def server_argv(args: list[str], command: list[str] | None = None) -> list[str]:
    """`command` + args; no command = `python -m sglang.launch_server` of this interpreter (then the
    package must be installed here; a command runs SGLang from another environment or a container)."""
    if command:
        return [*command, *args]
    require_module(SERVER_MODULE, "pip install 'sglang==0.5.23' on the GPU nodes, or set "
                                  "rollout.sglang.server_command")
    return [sys.executable, "-m", SERVER_MODULE, *args]


def router_argv(args: list[str], command: list[str] | None = None) -> list[str]:
    if command:
        return [*command, *args]
    require_module(ROUTER_MODULE, "pip install sglang-router, or set rollout.sglang.router_command")
    return [sys.executable, "-m", ROUTER_MODULE, *args]
