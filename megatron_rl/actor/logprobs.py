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


def _tp_rank_size(tp_group) -> tuple[int, int]:
    size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    return (dist.get_rank(tp_group) if size > 1 else 0), size


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, rank: int, tp_group, size: int):
    """Reduced (shift, sum_exp, target logit, sum e^z z) of one chunk, plus the shifted logits and
    their exp, which backward needs; every [n] statistic is already summed over the TP group."""
    shard_vocab = logits.shape[-1]
    shift = logits.amax(dim=-1)
    if size > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - shift[:, None]
    exp = shifted.exp()
    local = targets - rank * shard_vocab
    in_shard = (local >= 0) & (local < shard_vocab)
    picked = shifted.gather(-1, local.clamp(0, shard_vocab - 1)[:, None]).squeeze(-1) * in_shard
    # One all-reduce for the three sums of the chunk: [3, n].
    sums = torch.stack((exp.sum(dim=-1), picked, (exp * shifted).sum(dim=-1)))
    if size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    return shifted, exp, local, in_shard, sums


class _ChunkedLogprobs(torch.autograd.Function):
    """Log-probs and entropy of selected rows of [N, V/tp] logits, `chunk` rows at a time.

    Forward keeps no per-vocab intermediate: only the logits (which the output layer produced
    anyway) are saved, and backward recomputes each chunk's softmax to write its rows of the
    gradient. Extra memory is O(chunk x V/tp) both ways instead of several FP32 [N, V/tp] copies.
    Gradients (z = shifted logits, p = softmax over the full vocabulary, H = entropy):
      d logp_t / d z_v = [v == t] - p_v;   d H / d z_v = p_v * (W / Z - z_v),  W = sum_v e^z_v z_v.
    Each TP rank applies them to its own shard with the reduced Z, W: the identity-backward
    convention of the unchunked kernel above, with no collective in backward.
    """

    @staticmethod
    def forward(ctx, logits, rows, targets, chunk, tp_group):
        rank, size = _tp_rank_size(tp_group)
        logprobs = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logprobs)
        for start in range(0, rows.numel(), chunk):
            part = slice(start, start + chunk)
            z = logits.index_select(0, rows[part]).float()
            _, _, _, _, sums = _chunk_stats(z, targets[part], rank, tp_group, size)
            log_z = sums[0].log()
            logprobs[part] = sums[1] - log_z
            entropy[part] = log_z - sums[2] / sums[0]
        ctx.save_for_backward(logits, rows, targets)
        ctx.chunk, ctx.tp_group, ctx.rank, ctx.size = chunk, tp_group, rank, size
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, rows, targets = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for start in range(0, rows.numel(), ctx.chunk):
            part = slice(start, start + ctx.chunk)
            z = logits.index_select(0, rows[part]).float()
            shifted, exp, local, in_shard, sums = _chunk_stats(z, targets[part], ctx.rank,
                                                               ctx.tp_group, ctx.size)
            probs = exp / sums[0][:, None]
            mean_z = (sums[2] / sums[0])[:, None]
            g = probs * (grad_entropy[part, None] * (mean_z - shifted) - grad_logprobs[part, None])
            hit = grad_logprobs[part] * in_shard
            g.scatter_add_(-1, local.clamp(0, logits.shape[-1] - 1)[:, None], hit[:, None])
            grad.index_copy_(0, rows[part], g.to(grad.dtype))
        return grad, None, None, None, None


def chunked_logprobs_and_entropy(logits_shard: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                                 chunk_size: int, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy for selected rows of vocab-parallel logits, chunk by chunk.

    Args:
        logits_shard: [N, V/tp] float (any float dtype), this TP rank's vocab slice.
        rows: [M] int64 distinct row indices into logits_shard (e.g. the response tokens only).
        targets: [M] int64 token ids in [0, V), the token each selected row predicts.
        chunk_size: rows per chunk (> 0); peak extra memory is O(chunk_size x V/tp).
        tp_group: the tensor-parallel group the vocab is split over (None or size 1: unsharded).
    Returns:
        (logprobs [M] float32, entropy [M] float32), differentiable w.r.t. logits_shard.
    """
    if chunk_size < 1:
        raise ValueError(f"logprob chunk_size={chunk_size} must be >= 1")
    return _ChunkedLogprobs.apply(logits_shard, rows, targets, int(chunk_size), tp_group)
