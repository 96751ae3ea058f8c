"""Rollout engines behind one protocol (design.md section 5): the embedded torch engine and SGLang.

Attributes are imported on first use, so `megatron_rl.rollout.sglang_config` (a plain dataclass
the config reads) stays cheap to import.
"""

import importlib

_EXPORTS = {
    "RolloutEngine": "megatron_rl.rollout.base",
    "Sample": "megatron_rl.rollout.base",
    "SamplingParams": "megatron_rl.rollout.base",
    "tensor_digest": "megatron_rl.rollout.base",
    "TorchRolloutEngine": "megatron_rl.rollout.torch_engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_rl.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
