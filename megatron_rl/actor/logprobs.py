"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the full vocabulary.

Each TP rank holds logits for a contiguous vocab slice [rank * V/tp, (rank + 1) * V/tp). Four
[B, S] statistics are all-reduced over the TP group instead: the max (for stability), the sum of
exp, the target logit and the sum of exp * logit. The sums are differentiable with an identity
backward, Megatron's convention for a reduction whose result every TP rank then uses identically
(each rank's gradient is the gradient of the one replicated loss). That is exact only if reduced
values are never fed back into per-shard terms, which the formulas below respect.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """Forward: SUM all-reduce over `group`; backward: identity."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _reduce_sum(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    return _AllReduceSum.apply(tensor, group) if size > 1 else tensor


def vocab_parallel_logprobs_and_entropy(logits_shard: torch.Tensor, targets: torch.Tensor,
                                        tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of the softmax over the full (sharded) vocabulary.

    Args:
        logits_shard: [B, S, V/tp] float, this TP rank's vocab slice (rank-ordered, contiguous).
        targets: [B, S] int64 token ids in [0, V).
        tp_group: the tensor-parallel group the vocab is split over (None or size 1: unsharded).
    Returns:
        (logprobs [B, S] float32, entropy [B, S] float32), differentiable w.r.t. logits_shard.
    """
    size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(tp_group) if size > 1 else 0
    logits = logits_shard.float()
    shard_vocab = logits.shape[-1]
    # The max only shifts for stability; log-softmax is invariant to it, so no gradient flows.
    shift = logits.detach().amax(dim=-1)
    if size > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _reduce_sum(exp.sum(dim=-1), tp_group, size)
    log_z = sum_exp.log()  # log-normalizer of the shifted logits

    local = targets - rank * shard_vocab
    in_shard = (local >= 0) & (local < shard_vocab)
    picked = shifted.gather(-1, local.clamp(0, shard_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _reduce_sum(picked * in_shard, tp_group, size)
    logprobs = target_logit - log_z

    # H = log Z - (sum_v e^z_v z_v) / Z (z: shifted logits). The numerator is reduced on its own:
    # feeding the reduced Z back into per-shard terms (p_v = e^z_v / Z) would give Z gradient
    # contributions that live on other ranks, which an identity backward silently drops.
    weighted = _reduce_sum((exp * shifted).sum(dim=-1), tp_group, size)
    entropy = log_z - weighted / sum_exp
    return logprobs, entropy
