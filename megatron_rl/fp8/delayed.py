"""Delayed-scaling state of one linear layer: amax histories and scales, as checkpointable buffers.

TE's DelayedScaling quantizes each tensor with a scale derived from the amaxes of previous
iterations, records the current amax, then updates (scales.delayed_scale_update). Here every
FP8 linear owns one DelayedScalingState submodule whose buffers (`amax_history` [len, 3],
`scale` [3], `num_updates` [3], columns in ROLES order) are ordinary persistent buffers, so
`state_dict()` and Megatron's distributed checkpoint carry them and a resume continues with
bitwise the same scales.

When the history moves (a deliberate choice; TE updates after every FP8 forward):
- only in FP8 passes (never inside fp8_disabled(), the BF16 shadow), and
- only in training passes (module.training and grad enabled); the no-grad old-logprob and
  reference forwards read the scales but leave them untouched, so a training forward at the
  same weights quantizes exactly as the old-logprob forward did.
- Under activation recompute the layer's forward runs twice: the original (no grad) forward
  records as any training forward does and stashes the scales it used (`stash`); the recompute
  in backward reuses them in the same order (`pop_stashed`) and records nothing, so the amax is
  recorded once and the recomputed activations are bitwise the original ones, also when other
  forwards ran in between (pipeline warm-up). TE solves the same hazard in its own checkpoint.
- Until a role has been recorded once, its scale is computed from the current tensor
  (current scaling), instead of TE's initial scale of 1, which would quantize the first
  iteration's small weights into subnormals.
"""

from collections import deque

import torch
from torch import nn

from megatron_rl.fp8.scales import delayed_scale_update

ROLE_INDEX = {"input": 0, "weight": 1, "grad_output": 2}


class DelayedScalingState(nn.Module):
    """Amax histories and scales for the three GEMM operand roles of one linear layer."""

    def __init__(self, amax_history_len: int, amax_compute_algo: str = "max", margin: int = 0):
        super().__init__()
        self.amax_compute_algo = amax_compute_algo
        self.margin = margin
        self.register_buffer("amax_history", torch.zeros(amax_history_len, len(ROLE_INDEX)))
        self.register_buffer("scale", torch.ones(len(ROLE_INDEX)))
        self.register_buffer("num_updates", torch.zeros(len(ROLE_INDEX), dtype=torch.int64))
        # Scales used by checkpointed forwards, oldest first, awaiting their recompute (not state:
        # empty between train steps).
        self._stashed: dict[str, deque] = {role: deque() for role in ROLE_INDEX}

    def has_scale(self, role: str) -> bool:
        """Whether `role` has been recorded at least once (else use current scaling)."""
        return bool(self.num_updates[ROLE_INDEX[role]] > 0)

    def scale_of(self, role: str) -> torch.Tensor:
        """The quantization scale for `role` (float32 scalar, a copy)."""
        return self.scale[ROLE_INDEX[role]].clone()

    def stash(self, role: str, scale: torch.Tensor) -> None:
        """Keep the scale a checkpointed forward used, for its recompute."""
        self._stashed[role].append(scale)

    def pop_stashed(self, role: str) -> torch.Tensor:
        """The scale of the oldest checkpointed forward not yet recomputed."""
        if not self._stashed[role]:
            raise RuntimeError(f"delayed scaling: a recompute of '{role}' without its forward")
        return self._stashed[role].popleft()

    @torch.no_grad()
    def record(self, role: str, amax: torch.Tensor, fp8_max: float) -> None:
        """Write the current (already group-reduced) amax of `role` and update its scale.

        Args:
            role: "input", "weight" or "grad_output".
            amax: float32 scalar, max |tensor| over every shard of the logical tensor.
            fp8_max: max of the role's FP8 format (448 or 57344).
        """
        col = ROLE_INDEX[role]
        history = self.amax_history[:, col : col + 1]
        history[0, 0] = amax.to(history.dtype)
        delayed_scale_update(history, self.scale[col : col + 1], fp8_max, self.margin,
                             self.amax_compute_algo)
        self.num_updates[col] += 1

    def extra_repr(self) -> str:
        return (f"amax_history_len={self.amax_history.shape[0]}, "
                f"amax_compute_algo={self.amax_compute_algo!r}, margin={self.margin}")
