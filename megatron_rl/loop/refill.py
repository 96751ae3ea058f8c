"""DAPO dynamic sampling with refill: which kept groups of which generation round each DP rank trains.

A step samples rounds of `data.prompts_per_step` prompts (every DP rank its shard) until the
informative groups (rewards not all equal) kept over all rounds and ranks reach prompts_per_step,
or `algo.max_gen_batches` rounds were sampled. The first prompts_per_step kept groups in
(round, rank, group) order are trained, as verl's recipe/dapo trims its concatenated batch to
train_batch_size; the rest of the last round is discarded. Every rank derives the same plan from
the all-reduced per-rank counts, so the ranks agree on it without another collective.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("megatron_rl.loop.refill")


def needs_more(algo, target: int, counts: list[torch.Tensor], step: int) -> bool:
    """Whether to sample another round. counts: per round, kept groups per DP rank [dp] (global).

    At the limit (algo.max_gen_batches rounds, 0 = none) with fewer than `target` groups kept,
    algo.on_max_gen_batches decides: "train" on what was kept (logged), or "fail" (RuntimeError).
    """
    if not algo.dynamic_sampling:
        return False
    kept = int(sum(int(c.sum()) for c in counts))
    if kept >= target:
        return False
    if algo.max_gen_batches and len(counts) >= algo.max_gen_batches:
        message = (f"step {step}: {kept} of {target} informative groups after algo.max_gen_batches="
                   f"{algo.max_gen_batches} generation rounds")
        if algo.on_max_gen_batches == "fail":
            raise RuntimeError(f"{message} (algo.on_max_gen_batches=fail): the prompts are too easy or too "
                               "hard for the policy; raise algo.max_gen_batches or set it to 0 (no limit)")
        log.warning("%s: training on those (algo.on_max_gen_batches=train)", message)
        return False
    return True


def plan(counts: list[torch.Tensor], target: int, dp_rank: int) -> tuple[list[int], int, int]:
    """(groups this rank takes from each round, the most any rank takes, groups taken in all).

    Groups are taken in (round, rank, group) order until `target`; a rank that takes fewer than
    the most pads its batch with fully masked rows (equal row counts keep the collectives matched).
    """
    remaining, mine, per_rank = target, [], torch.zeros(len(counts[0]) if counts else 0, dtype=torch.long)
    for round_counts in counts:
        take = torch.zeros_like(per_rank)
        for rank, available in enumerate(round_counts.tolist()):
            take[rank] = min(int(available), remaining)
            remaining -= int(take[rank])
        per_rank += take
        mine.append(int(take[dp_rank]))
    return mine, int(per_rank.max()) if len(per_rank) else 0, target - remaining


def kept_rows(keep: torch.Tensor, group_size: int, groups: int) -> torch.Tensor:
    """Row indices [groups * group_size] of the first `groups` kept groups (keep: [N] bool, group-wise)."""
    kept_groups = torch.nonzero(keep.view(-1, group_size).all(dim=1)).flatten()[:groups]
    return (kept_groups[:, None] * group_size + torch.arange(group_size)).flatten()
