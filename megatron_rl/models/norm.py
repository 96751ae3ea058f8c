"""RMSNorm for the local (non-TE) layer spec that also runs under sequence parallel.

Megatron's WrappedTorchNorm (torch_norm.py:32) refuses sequence_parallel. Under SP each TP rank
normalizes its own slice of the sequence, so the norm weight's gradient is a partial sum that
finalize_model_grads all-reduces over the TP group for parameters tagged `sequence_parallel`
(finalize_model_grads.py:354), as TE's and apex's norms tag theirs. This is torch.nn.RMSNorm
(the same numerics as WrappedTorchNorm) with that tag.
"""

from __future__ import annotations

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm with Megatron's norm constructor signature and the SP gradient tag."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"LocalRMSNorm got normalization={config.normalization!r}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
