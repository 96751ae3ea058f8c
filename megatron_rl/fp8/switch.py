"""The FP8 on/off switch: `with fp8_disabled():` runs emulated FP8 layers in high precision.

This is the BF16 shadow forward of calibrated clipping: the same modules and the very same
parameter tensors, with every quantization point skipped (no weight copies, no amax-history
updates). The flag is thread-local (a `with` block belongs to the thread that entered it) and
nesting-safe (a depth counter). It governs the trainer's emulated FP8 linears only; the rollout
engine's W8A8 layers follow the `rollout_quant` config instead.
"""

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


def fp8_enabled() -> bool:
    """True unless the calling thread is inside `fp8_disabled()`."""
    return getattr(_state, "disabled_depth", 0) == 0


@contextlib.contextmanager
def fp8_disabled() -> Iterator[None]:
    """Context manager: emulated FP8 linears compute in high precision inside the block."""
    _state.disabled_depth = getattr(_state, "disabled_depth", 0) + 1
    try:
        yield
    finally:
        _state.disabled_depth -= 1
