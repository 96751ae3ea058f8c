"""One forward pass of a GPTModel chunk with per-token RoPE, and the per-micro-batch step functions
handed to Megatron's forward_backward_func."""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator

import torch

from megatron_rl.actor.batch import attention_mask_of, position_ids_of, sequence_starts
from megatron_rl.actor.logprobs import vocab_parallel_logprobs_and_entropy
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
                attention_mask: torch.Tensor | None, inv_freq: torch.Tensor) -> torch.Tensor:
    """Embedding -> decoder -> output layer of one pipeline chunk.

    GPTModel.forward is not used because it derives RoPE from 0..S-1 and ignores position_ids;
    these are its three parts with our angles (models/rope.py). On a non-first stage the decoder
    reads the activation the schedule set with set_input_tensor.

    Args:
        tokens, position_ids: [B, S] int64; attention_mask: [B, 1, S, S] bool (True = masked) or None.
    Returns:
        last stage: logits [S, B, V/tp]; other stages: hidden states [S, B, H].
    """
    gpt = unwrap_model(model)
    hidden = gpt.embedding(input_ids=tokens, position_ids=position_ids) if gpt.pre_process else None
    rotary = rope_angles(inv_freq, position_ids)
    hidden = gpt.decoder(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=rotary)
    if not gpt.post_process:
        return hidden
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden, weight=weight)
    return logits


def token_logprobs(logits_SBV: torch.Tensor, micro_batch: dict,
                   tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned log-probs and entropy [b, S]: entry t is about tokens[:, t] given tokens[:, :t].

    Entries with no prediction (t = 0 and each packed sequence's first token) are 0.
    """
    tokens = micro_batch["tokens"]
    logits = logits_SBV.transpose(0, 1)[:, :-1]  # [b, S-1, V/tp] predicts tokens[:, 1:]
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(logits, tokens[:, 1:], tp_group)
    pad = torch.zeros_like(logprobs[:, :1])
    logprobs = torch.cat((pad, logprobs), dim=1)
    entropy = torch.cat((pad, entropy), dim=1)
    keep = ~sequence_starts(micro_batch)
    return logprobs * keep, entropy * keep


LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict]]


def make_forward_step(inv_freq: torch.Tensor, tp_group, loss_fn: LossFn | None,
                      with_entropy: bool = True):
    """forward_step_func(data_iterator, model) for megatron's forward_backward_func.

    With loss_fn None (no-grad log-prob pass) the "loss" is 0 and the reduced output carries
    logprobs / entropy; otherwise it carries the loss_fn metrics and the loss itself.
    """

    device = compute_device()

    def forward_step(data_iterator: Iterator[dict], model: torch.nn.Module):
        micro_batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                       for k, v in next(data_iterator).items()}
        output = gpt_forward(model, micro_batch["tokens"], position_ids_of(micro_batch),
                             attention_mask_of(micro_batch), inv_freq)
        return output, partial(_loss_func, micro_batch, tp_group, loss_fn, with_entropy)

    return forward_step


def _loss_func(micro_batch: dict, tp_group, loss_fn: LossFn | None, with_entropy: bool,
               logits: torch.Tensor):
    """Megatron loss_func contract (3-tuple, calculate_per_token_loss=True): (loss, num_tokens,
    reduced). The loss already carries the global denominator, so num_tokens is 0: the schedule
    then neither divides by the number of micro-batches nor finalize_model_grads by a token count
    (finalize_model_grads.py:495 skips scaling when the count is 0)."""
    logprobs, entropy = token_logprobs(logits, micro_batch, tp_group)
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
