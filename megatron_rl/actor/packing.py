"""Packed micro-batches: padded rows -> rows of whole sequences filled to a token budget, and back.

A padded batch has B rows of width S; row b's sequence is its first `length_b` tokens, where
length_b ends at its last loss-mask (response) token: later tokens never influence a loss term
(attention is causal), so they are not computed. Packing places whole sequences, first-fit
decreasing, into rows of at most `budget` tokens, then pads every row to one common width that is a
multiple of what the FP8 GEMMs need (`pad_multiple`). Each packed row is one micro-batch, in the
actor's packed-row format (actor/batch.py: `seq_lens`, positions restarting per sequence).

    packed, index = pack_batch(batch, budget=16384, multiple=128)
    out = actor.compute_logprobs(packed, micro_batch_size=1)
    logprobs_BS = unpack(out["logprobs"], index)             # back to the padded layout
    ...loss_fn(logprobs, entropy, mb): per_sequence(...)    # one row per sequence for the loss

Legend: B padded rows of width S; R packed rows of width W; K sequences per packed row at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Token-count multiples Transformer Engine's FP8 GEMMs need (NeMo-RL pads to the same values):
# blockwise scales cover 128 tokens, MXFP8 and MXFP4 32, every FP8 GEMM asserts a multiple of 16,
# and FP4 GEMMs want 32 (16-byte TMA rows of 4-bit values: megatron-core fp4_utils.get_fp4_align_size).
_RECIPE_MULTIPLE = {"blockwise": 128, "mxfp8": 32, "nvfp4": 32, "mxfp4": 32}


def pad_multiple(train_recipe: str, tp_size: int, sequence_parallel: bool) -> int:
    """Tokens per packed micro-batch must be a multiple of this (x TP: SP splits the sequence)."""
    base = _RECIPE_MULTIPLE.get(train_recipe, 16)
    return base * (tp_size if sequence_parallel else 1)


@dataclass
class PackIndex:
    """Where each padded row's sequence went: row, offset, length (all [B] int64), and the padded
    batch's shape."""

    row: torch.Tensor
    offset: torch.Tensor
    length: torch.Tensor
    shape: tuple[int, int]


def sequence_lengths(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: 1 + index of each row's last loss-mask token (0 for a row with none)."""
    on = loss_mask > 0
    last = torch.arange(1, on.shape[1] + 1).expand_as(on) * on
    return last.amax(dim=1) if on.shape[1] else torch.zeros(on.shape[0], dtype=torch.int64)


def plan_packs(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing bins of sequence indices, each summing to <= budget (deterministic:
    ties keep index order). Zero-length sequences are left out."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        if lengths[i] > budget:
            raise ValueError(f"sequence of {lengths[i]} tokens exceeds "
                             f"train.max_tokens_per_micro_batch={budget}")
        slot = next((k for k, used in enumerate(fill) if used + lengths[i] <= budget), None)
        if slot is None:
            bins.append([])
            fill.append(0)
            slot = len(bins) - 1
        bins[slot].append(i)
        fill[slot] += lengths[i]
    return bins


def pack_batch(batch: dict, budget: int, multiple: int) -> tuple[dict, PackIndex]:
    """Pack a padded batch into rows of <= budget tokens (+ padding to `multiple`).

    Every [B, S] tensor of `batch` is packed alongside the tokens (the loss inputs follow their
    tokens); other entries are dropped. A batch with no loss token gives one all-padding row, so
    every rank still runs a micro-batch (collectives stay matched).
    Returns (packed batch: [R, W] tensors + seq_lens [R, K], index for `unpack`).
    """
    tokens = batch["tokens"]
    num_rows, seq_len = tokens.shape
    lengths = sequence_lengths(batch["loss_mask"])
    bins = plan_packs(lengths.tolist(), budget) or [[]]
    width = max(multiple, -(-max(int(lengths[b].sum()) for b in bins) // multiple) * multiple)
    row, offset = torch.zeros(num_rows, dtype=torch.int64), torch.zeros(num_rows, dtype=torch.int64)
    seq_lens = torch.zeros(len(bins), max(1, max(len(b) for b in bins)), dtype=torch.int64)
    for r, members in enumerate(bins):
        start = 0
        for k, i in enumerate(members):
            row[i], offset[i], seq_lens[r, k] = r, start, lengths[i]
            start += int(lengths[i])
    index = PackIndex(row, offset, lengths, (num_rows, seq_len))
    packed = {key: _scatter(value, index, width, len(bins)) for key, value in batch.items()
              if isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == (num_rows, seq_len)}
    packed["seq_lens"] = seq_lens
    return packed, index


def _token_coords(index: PackIndex) -> tuple[torch.Tensor, ...]:
    """(padded row, padded column, packed row, packed column) [N] of every packed token."""
    src_row = torch.repeat_interleave(torch.arange(index.length.numel()), index.length)
    starts = torch.repeat_interleave(index.length.cumsum(0) - index.length, index.length)
    src_col = torch.arange(src_row.numel()) - starts
    return src_row, src_col, index.row[src_row], index.offset[src_row] + src_col


def _scatter(value: torch.Tensor, index: PackIndex, width: int, num_packed: int) -> torch.Tensor:
    out = value.new_zeros((num_packed, width) + tuple(value.shape[2:]))
    src_row, src_col, dst_row, dst_col = _token_coords(index)
    out[dst_row, dst_col] = value[src_row, src_col]
    return out


def unpack(packed: torch.Tensor, index: PackIndex) -> torch.Tensor:
    """[R, W] per-token values of a packed batch -> [B, S] in the padded layout (0 past each
    sequence's length)."""
    out = packed.new_zeros(index.shape + tuple(packed.shape[2:]))
    src_row, src_col, dst_row, dst_col = _token_coords(index)
    out[src_row, src_col] = packed[dst_row, dst_col]
    return out


def as_sequences(values: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """One packed row's per-token values [1, W] -> [K, L] with one row per sequence (L: longest),
    zero-filled; differentiable. The loss aggregates per row, so per-sequence modes (seq-mean)
    stay exact on packed micro-batches.
    """
    assert values.shape[0] == 1 and seq_lens.shape[0] == 1, "one packed row per micro-batch"
    lens = seq_lens[0]
    width = values.shape[1]
    longest = max(int(lens.max()), 1)
    starts = lens.cumsum(0) - lens
    cols = starts[:, None] + torch.arange(longest, device=lens.device)
    inside = torch.arange(longest, device=lens.device) < lens[:, None]
    flat = torch.cat((values[0], values.new_zeros((1,) + tuple(values.shape[2:]))))
    return flat[torch.where(inside, cols, width)]


def thd_params(seq_lens: torch.Tensor, width: int):
    """Megatron PackedSeqParams (THD) for one packed row: cu_seqlens over its sequences, with the
    trailing padding as one more sequence so cu_seqlens[-1] == width. Megatron's THD RoPE then
    takes our per-token angles by offset (rope_utils._apply_rotary_pos_emb_thd, "exact mapping"
    when freqs has cu_seqlens[-1] rows), so positions restarting per sequence stay exact.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    assert seq_lens.shape[0] == 1, "THD packing takes one packed row per micro-batch"
    lens = seq_lens[0][seq_lens[0] > 0]
    tail = width - int(lens.sum())
    if tail:
        lens = torch.cat((lens, lens.new_tensor([tail])))
    cu = torch.cat((lens.new_zeros(1), lens.cumsum(0))).to(torch.int32)
    longest = int(lens.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def per_sequence(logprobs: torch.Tensor, entropy: torch.Tensor, micro_batch: dict):
    """A loss_fn's inputs for a packed micro-batch -> one row per sequence (`as_sequences` on every
    per-token tensor); a padded micro-batch is returned as is."""
    if "seq_lens" not in micro_batch:
        return logprobs, entropy, micro_batch
    lens = micro_batch["seq_lens"]
    rows = {k: as_sequences(v, lens) for k, v in micro_batch.items()
            if isinstance(v, torch.Tensor) and k != "seq_lens"}
    return as_sequences(logprobs, lens), as_sequences(entropy, lens), rows
