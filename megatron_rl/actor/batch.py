"""The actor's batch format: validation, micro-batch slicing, positions and packed-row attention masks.

A batch is a dict of CPU tensors:
- tokens [B, S] int64: prompt + response, right-padded;
- loss_mask [B, S] float32: 1 at positions t whose token tokens[:, t] is a response token;
- position_ids [B, S] int64 (optional; default 0..S-1, or restarting per packed sequence);
- seq_lens [B, K] int64 (optional, packed rows): lengths of the sequences concatenated in each
  row, in order, zero-padded on the right; tokens after their sum are padding;
- any other [B, ...] tensor (advantages, old_logprobs, ...) is sliced per micro-batch for the loss.
"""

from __future__ import annotations

import torch

REQUIRED = ("tokens", "loss_mask")


def validate_batch(batch: dict, vocab_size: int, micro_batch_size: int) -> None:
    """Raises ValueError naming the bad key or value."""
    for key in REQUIRED:
        if key not in batch:
            raise ValueError(f"batch is missing {key!r} (has {sorted(batch)})")
    tokens = batch["tokens"]
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"batch['tokens'] must be [B, S] int64, got {tuple(tokens.shape)} {tokens.dtype}")
    num_rows, seq_len = tokens.shape
    for key in ("loss_mask", "position_ids"):
        if key in batch and tuple(batch[key].shape) != (num_rows, seq_len):
            raise ValueError(f"batch[{key!r}] has shape {tuple(batch[key].shape)}, "
                             f"expected {(num_rows, seq_len)} like tokens")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"batch['tokens'] has ids outside [0, {vocab_size}): "
                         f"min {int(tokens.min())}, max {int(tokens.max())}")
    if micro_batch_size < 1 or num_rows % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide the batch size {num_rows}")
    if "seq_lens" in batch:
        _validate_seq_lens(batch["seq_lens"], num_rows, seq_len)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] != num_rows:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, tokens has {num_rows}")


def _validate_seq_lens(seq_lens: torch.Tensor, num_rows: int, seq_len: int) -> None:
    if seq_lens.dim() != 2 or seq_lens.shape[0] != num_rows:
        raise ValueError(f"batch['seq_lens'] must be [B, K] with B={num_rows}, "
                         f"got {tuple(seq_lens.shape)}")
    if int(seq_lens.min()) < 0 or int(seq_lens.sum(dim=1).max()) > seq_len:
        raise ValueError(f"batch['seq_lens'] rows must be >= 0 and sum to <= S={seq_len}")


def split_micro_batches(batch: dict, micro_batch_size: int) -> list[dict]:
    """Slices every tensor along dim 0; other values are shared by all micro-batches."""
    num_rows = batch["tokens"].shape[0]
    out = []
    for start in range(0, num_rows, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        out.append({k: v[rows] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v
                    for k, v in batch.items()})
    return out


def segment_ids(seq_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, K] packed lengths -> [B, S] int64 index of the sequence each token belongs to.

    Padding after the last sequence gets index K (its own segment).
    """
    ends = seq_lens.cumsum(dim=1)  # [B, K] exclusive end of each sequence
    pos = torch.arange(seq_len, device=seq_lens.device).expand(seq_lens.shape[0], seq_len)
    return torch.searchsorted(ends.contiguous(), pos.contiguous(), right=True)


def position_ids_of(batch: dict) -> torch.Tensor:
    """[B, S] int64 positions: given, restarting per packed sequence, or 0..S-1."""
    tokens = batch["tokens"]
    if "position_ids" in batch:
        return batch["position_ids"].to(torch.int64)
    num_rows, seq_len = tokens.shape
    pos = torch.arange(seq_len, device=tokens.device).expand(num_rows, seq_len)
    if "seq_lens" not in batch:
        return pos.contiguous()
    seq_lens = batch["seq_lens"]
    starts = torch.cat((torch.zeros_like(seq_lens[:, :1]), seq_lens.cumsum(dim=1)), dim=1)
    seg = segment_ids(seq_lens, seq_len)
    return pos - starts.gather(1, seg)


def attention_mask_of(batch: dict) -> torch.Tensor | None:
    """Block-diagonal causal mask [B, 1, S, S] bool (True = masked) for packed rows, else None
    (plain causal: with right padding real tokens never see the pads)."""
    if "seq_lens" not in batch:
        return None
    seq_len = batch["tokens"].shape[1]
    seg = segment_ids(batch["seq_lens"], seq_len)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=seg.device).tril()
    same = seg[:, :, None] == seg[:, None, :]
    return ~(same & causal)[:, None]


def sequence_starts(batch: dict) -> torch.Tensor:
    """[B, S] bool: the first token of each sequence (t = 0, and each packed sequence's start),
    where no log-prob is defined."""
    tokens = batch["tokens"]
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    if "seq_lens" in batch:
        pos = position_ids_of({k: v for k, v in batch.items() if k != "position_ids"})
        starts |= pos == 0
    return starts
