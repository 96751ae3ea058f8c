"""One forward pass of a GPTModel chunk with per-token RoPE, and the per-micro-batch step functions
handed to Megatron's forward_backward_func."""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator

import torch

from megatron_rl.actor.batch import attention_mask_of, position_ids_of, sequence_starts
from megatron_rl.actor.logprobs import chunked_logprobs_and_entropy, vocab_parallel_logprobs_and_entropy
from megatron_rl.actor.packing import thd_params
from megatron_rl.models.rope import rope_angles


def compute_device() -> torch.device:
    """Where the model lives: the current CUDA device, else the CPU (batches arrive on the CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def gpt_forward(model: torch.nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, inv_freq: torch.Tensor,
                packed_seq_params=None) -> torch.Tensor:
    """Embedding -> decoder -> output layer of one pipeline chunk.

    GPTModel.forward is not used because it derives RoPE from 0..S-1 and ignores position_ids;
    these are its three parts with our angles (models/rope.py). On a non-first stage the decoder
    reads the activation the schedule set with set_input_tensor.

    Args:
        tokens, position_ids: [B, S] int64; attention_mask: [B, 1, S, S] bool (True = masked) or None.
        packed_seq_params: THD packing (TE spec, B = 1; actor/packing.py thd_params) or None.
    Returns:
        last stage: logits [S, B, V/tp]; other stages: hidden states [S, B, H].
    """
    gpt = unwrap_model(model)
    hidden = gpt.embedding(input_ids=tokens, position_ids=position_ids) if gpt.pre_process else None
    rotary = rope_angles(inv_freq, position_ids)
    hidden = gpt.decoder(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=rotary,
                         packed_seq_params=packed_seq_params)
    if not gpt.post_process:
        return hidden
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden, weight=weight)
    return logits


def token_logprobs(logits_SBV: torch.Tensor, micro_batch: dict, tp_group,
                   chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned log-probs and entropy [b, S]: entry t is about tokens[:, t] given tokens[:, :t].

    Entries with no prediction (t = 0 and each packed sequence's first token) are 0. chunk_size > 0
    evaluates only the loss-mask (response) tokens, chunk_size at a time (actor/logprobs.py); the
    other entries are then 0 too.
    """
    if chunk_size > 0:
        return _response_logprobs(logits_SBV, micro_batch, tp_group, chunk_size)
    tokens = micro_batch["tokens"]
    logits = logits_SBV.transpose(0, 1)[:, :-1]  # [b, S-1, V/tp] predicts tokens[:, 1:]
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, tokens[:, 1:], tp_group)
    pad = torch.zeros_like(logprobs[:, :1])
    logprobs = torch.cat((pad, logprobs), dim=1)
    entropy = torch.cat((pad, entropy), dim=1)
    keep = ~sequence_starts(micro_batch)
    return logprobs * keep, entropy * keep


def _response_logprobs(logits_SBV: torch.Tensor, micro_batch: dict, tp_group,
                       chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = micro_batch["tokens"]
    rows, seq_len = tokens.shape
    wanted = (micro_batch["loss_mask"] > 0) & ~sequence_starts(micro_batch)
    row_idx, t_idx = wanted.nonzero(as_tuple=True)
    # logits_SBV[t - 1, b] predicts tokens[b, t]; flattened [S * b, V/tp] row (t - 1) * b + b_idx.
    flat = logits_SBV.reshape(-1, logits_SBV.shape[-1])
    logprobs, entropy = chunked_logprobs_and_entropy(flat, (t_idx - 1) * rows + row_idx,
                                                     tokens[row_idx, t_idx], chunk_size, tp_group)
    out_lp = torch.zeros(rows, seq_len, dtype=torch.float32, device=tokens.device)
    out_ent = torch.zeros_like(out_lp)
    return out_lp.index_put((row_idx, t_idx), logprobs), out_ent.index_put((row_idx, t_idx), entropy)


LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict]]


def make_forward_step(inv_freq: torch.Tensor, tp_group, loss_fn: LossFn | None,
                      with_entropy: bool = True, logprob_chunk_size: int = 0, thd: bool = False):
    """forward_step_func(data_iterator, model) for megatron's forward_backward_func.

    thd=True (TE spec): packed rows go through attention as THD with cu_seqlens instead of a
    dense block-diagonal mask, which TE's causal kernels would ignore.

    With loss_fn None (no-grad log-prob pass) the "loss" is 0 and the reduced output carries
    logprobs / entropy; otherwise it carries the loss_fn metrics and the loss itself.
    """

    device = compute_device()

    def forward_step(data_iterator: Iterator[dict], model: torch.nn.Module):
        micro_batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                       for k, v in next(data_iterator).items()}
        packed = thd and "seq_lens" in micro_batch
        params = thd_params(micro_batch["seq_lens"], micro_batch["tokens"].shape[1]) if packed else None
        output = gpt_forward(model, micro_batch["tokens"], position_ids_of(micro_batch),
                             None if packed else attention_mask_of(micro_batch), inv_freq, params)
        return output, partial(_loss_func, micro_batch, tp_group, loss_fn, with_entropy,
                               logprob_chunk_size)

    return forward_step


def _loss_func(micro_batch: dict, tp_group, loss_fn: LossFn | None, with_entropy: bool,
               chunk_size: int, logits: torch.Tensor):
    """Megatron loss_func contract (3-tuple, calculate_per_token_loss=True): (loss, num_tokens,
    reduced). The loss already carries the global denominator, so num_tokens is 0: the schedule
    then neither divides by the number of micro-batches nor finalize_model_grads by a token count
    (finalize_model_grads.py:495 skips scaling when the count is 0)."""
    logprobs, entropy = token_logprobs(logits, micro_batch, tp_group, chunk_size)
    num_tokens = torch.zeros((), dtype=torch.int)
    if loss_fn is None:
        out = {"logprobs": logprobs.detach(), "entropy": entropy.detach() if with_entropy else None}
        return logprobs.sum() * 0.0, num_tokens, out
    loss, metrics = loss_fn(logprobs, entropy, micro_batch)
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
    # Left on the device: a .cpu() here would sync the host once per micro-batch (the actor
    # moves them after the schedule, once per step).
    metrics = {key: value.detach() for key, value in metrics.items()}
    return loss, num_tokens, {"loss": loss.detach(), "metrics": metrics}
