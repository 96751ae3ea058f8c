"""A quiet start: Megatron-Core's start-up chatter goes to the log at DEBUG.

Megatron warns at import about missing TE / apex (expected on CPU), logs every DDP bucket's
parameter list and the whole optimizer config at INFO. The build logs one summary line instead
(build.log_actor_settings); the `megatron_rl.megatron` logger at DEBUG still shows all of it.
Warnings from elsewhere pass through unchanged; Megatron's own WARNING+ log records keep their level.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

log = logging.getLogger("megatron_rl.megatron")


class _DemoteInfo(logging.Handler):
    """Re-logs a Megatron record through megatron_rl's logger: INFO and below at DEBUG."""

    def emit(self, record: logging.LogRecord) -> None:
        level = logging.DEBUG if record.levelno < logging.WARNING else record.levelno
        log.log(level, "%s: %s", record.name, record.getMessage())


def demote_megatron_logs() -> None:
    """Route the `megatron` logger tree through _DemoteInfo (idempotent)."""
    root = logging.getLogger("megatron")
    if not any(isinstance(h, _DemoteInfo) for h in root.handlers):
        root.addHandler(_DemoteInfo())
    root.propagate = False  # every time: logging setups elsewhere (logging.config) may reset it


@contextlib.contextmanager
def megatron_quiet() -> Iterator[None]:
    """Inside: Megatron's log records demoted, and warnings raised from megatron/ files go to
    DEBUG; other warnings are re-issued as they came."""
    demote_megatron_logs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if "megatron/core" in w.filename.replace("\\", "/"):
            log.debug("%s:%d: %s", w.filename, w.lineno, w.message)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
