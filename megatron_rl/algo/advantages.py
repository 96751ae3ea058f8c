"""Outcome-reward advantages (GRPO, Dr. GRPO, leave-one-out, REINFORCE++ with baseline) and DAPO's
group filter and overlong shaping."""

from __future__ import annotations

import torch

from megatron_rl.algo.metrics import Reducer, identity_reduce


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """View rewards [N] as [N / group_size, group_size]; groups are contiguous."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group-relative baseline needs two samples), got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"len(rewards)={rewards.numel()} is not a multiple of group_size={group_size}")
    return rewards.reshape(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    norm_by_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages of outcome rewards.

    A_i = (R_i - b_i) / (std_g + eps) with the group's unbiased std (as slime and verl). The baseline
    b_i is the group mean, or with `leave_one_out` the mean of the other G - 1 rewards (RLOO,
    NeMo-RL's default), which scales the centred reward by G / (G - 1). `norm_by_std=False` is
    Dr. GRPO: no division. A group of equal rewards gets A = 0 in every mode.

    Args:
        rewards: [N] float, groups of `group_size` consecutive samples of one prompt.
        group_size: G >= 2; N % G == 0.

    Returns:
        [N] float32 advantages (one per sample; broadcast over its response tokens).
    """
    grouped = _grouped(rewards.to(torch.float32), group_size)
    total = grouped.sum(dim=1, keepdim=True)
    if leave_one_out:
        baseline = (total - grouped) / (group_size - 1)
    else:
        baseline = total / group_size
    adv = grouped - baseline
    if norm_by_std:
        adv = adv / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    # Rounding in the baseline leaves ~1e-8 residues on equal rewards, which the division by
    # (0 + eps) would blow up to ~0.01: zero such groups exactly.
    constant = (grouped.amax(dim=1) == grouped.amin(dim=1)).unsqueeze(1)
    return torch.where(constant, 0.0, adv).reshape(-1)


def reinforce_baseline_advantages(
    rewards: torch.Tensor,
    group_size: int,
    token_counts: torch.Tensor,
    reduce: Reducer | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ with baseline: the group mean subtracted, then whitened over the GLOBAL batch.

    c_i = R_i - mean_g(R); A_i = (c_i - mu) / sqrt(var + eps), with mu and the unbiased var taken
    over every response token of the global batch (each sample's c_i counted once per token, as
    verl's masked_whiten of the broadcast score; OpenRLHF `reinforce_baseline`, slime
    `reinforce_plus_plus_baseline`). Unlike GRPO no per-group std: the scale is the batch's.

    Args:
        rewards: [N] float, contiguous groups of `group_size` (this DP rank's shard).
        token_counts: [N] response tokens per sample (0 leaves a sample out of mu and var, e.g. a
            group dynamic sampling drops).
        reduce: sums a float64 tensor across DP ranks (all_reduce on the DP group); one call.

    Returns:
        [N] float32 advantages (a sample with no tokens still gets its whitened value).
    """
    grouped = _grouped(rewards.to(torch.float64), group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    n = token_counts.to(torch.float64)
    sums = torch.stack([n.sum(), (n * centred).sum(), (n * centred.square()).sum()])
    count, total, total_sq = (reduce or identity_reduce)(sums).tolist()
    if count < 2:
        raise ValueError(f"reinforce_plus_plus_baseline needs >= 2 response tokens in the batch, got {count}")
    mean = total / count
    var = (total_sq - count * mean * mean) / (count - 1)
    return ((centred - mean) / (max(var, 0.0) + eps) ** 0.5).to(torch.float32)


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal.

    Exact comparison (max != min), not a variance threshold: a group of identical rewards has
    zero advantage under every estimator above and contributes no gradient.

    Args:
        rewards: [N] float, contiguous groups of `group_size`.

    Returns:
        [N] bool, True for every sample of a kept group.
    """
    grouped = _grouped(rewards, group_size)
    varied = grouped.amax(dim=1) != grouped.amin(dim=1)
    return varied.repeat_interleave(group_size)


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_len: int,
    buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the rewards.

    0 up to max_response_len - buffer_len tokens, then falling linearly to -penalty_factor at
    max_response_len, and -penalty_factor beyond it (DAPO eq. 13).

    Args:
        response_lengths: [N] integer token counts.

    Returns:
        [N] float32 penalties, all <= 0.
    """
    if buffer_len <= 0 or buffer_len > max_response_len:
        raise ValueError(f"buffer_len must be in (0, max_response_len={max_response_len}], got {buffer_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    exceed = response_lengths.to(torch.float32) - (max_response_len - buffer_len)
    penalty = -exceed.clamp(min=0.0, max=float(buffer_len)) / buffer_len * penalty_factor
    # -0.0 would print oddly in logs; make the no-penalty case a plain zero.
    return penalty + 0.0
