"""Per-token KL estimators k1 / k2 / k3 (Schulman's approximations) against a reference policy."""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3")

# Bound on |log q - log p| inside k3's exp: exp(20) ~ 5e8 is finite in float32 and far past any
# ratio a healthy run produces; without it one wild token turns the loss into inf.
K3_LOG_RATIO_CLAMP = 20.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled under pi.

    With d = log pi_ref - log pi (same formulas as slime, verl and NeMo-RL):
      k1 = -d                   (unbiased, can be negative)
      k2 = d^2 / 2              (biased, >= 0)
      k3 = exp(d) - 1 - d       (unbiased, >= 0; d clamped to +-20 before exp, no output clamp)

    Args:
        logprobs: [B, T] float, log pi of the sampled tokens (carries grad).
        ref_logprobs: [B, T] float, log pi_ref of the same tokens (no grad needed).
        kl_type: "k1" | "k2" | "k3".

    Returns:
        [B, T] per-token estimate; masking is the caller's job.
    """
    d = ref_logprobs - logprobs
    if kl_type == "k1":
        return -d
    if kl_type == "k2":
        return 0.5 * d.square()
    if kl_type == "k3":
        d = d.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return torch.expm1(d) - d
    raise ValueError(f"kl_loss_type must be one of {KL_TYPES}, got {kl_type!r}")
