"""From rollout samples to the trainer's padded batch, and mini-batch slicing.

Shapes: B = sequences, S = padded length (prompt + response). Every per-token tensor is aligned
with `tokens`: position t carries the quantity of token tokens[:, t] (its log-prob, its
advantage), and `loss_mask[:, t] = 1` exactly on response tokens.
"""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]


def collate(samples, advantages: torch.Tensor, pad_id: int) -> Batch:
    """Right-pad samples into a batch.

    Args:
        samples: rollout samples (prompt_ids, response_ids, rollout_logprobs per response token).
        advantages: [B] float32, one per sample (GRPO broadcasts it over the sample's tokens).
    Returns:
        tokens [B,S] int64, loss_mask [B,S] float32, advantages [B,S] float32,
        rollout_logprobs [B,S] float32, response_lengths [B] int64.
    """
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    num = len(samples)
    tokens = torch.full((num, width), pad_id, dtype=torch.long)
    mask = torch.zeros(num, width)
    rollout_lp = torch.zeros(num, width)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[row, : p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
        mask[row, p: p + r] = 1.0
        rollout_lp[row, p: p + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return {
        "tokens": tokens,
        "loss_mask": mask,
        "advantages": advantages.float()[:, None] * mask,
        "rollout_logprobs": rollout_lp,
        "response_lengths": torch.tensor([len(s.response_ids) for s in samples]),
    }


def slice_batch(batch: Batch, index: torch.Tensor | slice) -> Batch:
    return {k: v[index] for k, v in batch.items()}


def mini_batches(batch: Batch, num_mini_batches: int, generator: torch.Generator) -> list[Batch]:
    """Shuffle sequences and split into `num_mini_batches` parts of near-equal size."""
    num = batch["tokens"].shape[0]
    order = torch.randperm(num, generator=generator)
    parts = torch.tensor_split(order, min(num_mini_batches, num))
    return [slice_batch(batch, idx) for idx in parts]
