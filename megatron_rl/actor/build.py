"""Build the actor's Megatron pieces: TransformerConfig, GPTModel stage wrapped in DDP, optimizer."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_rl.actor.parallel import ParallelInfo
from megatron_rl.models.hf_config import ModelSpec, gpt_model_kwargs, transformer_config_kwargs
from megatron_rl.models.layer_spec import build_layer_spec


def build_transformer_config(spec: ModelSpec, parallel: ParallelInfo, params_dtype: torch.dtype,
                             te_fp8_recipe: Any = None):
    """TransformerConfig of the actor; te_fp8_recipe (TE spec only) sets Megatron's fp8 fields.

    Weights are always initialized, even when a checkpoint overwrites them next: with
    perform_initialization=False Megatron also skips tagging TP-sharded weights
    (tensor_model_parallel, partition_dim; tensor_parallel/layers.py:855-884), and the grad norm
    then drops the shards of every TP rank but the first.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype={params_dtype} is not supported (float32 or bfloat16)")
    if params_dtype == torch.bfloat16 and not torch.cuda.is_available():
        # Megatron's mixed-precision optimizer type-checks for CUDA tensors (ecosystem.md).
        raise ValueError("params_dtype=torch.bfloat16 needs CUDA; use torch.float32 on CPU")
    kwargs = transformer_config_kwargs(spec, tp=parallel.tp_size, pp=parallel.pp_size,
                                       params_dtype=params_dtype)
    # The loss handed to the schedule already carries the GLOBAL denominator (the loss_fn's
    # contract). calculate_per_token_loss=True is Megatron's switch for that: the schedule does
    # not divide by num_microbatches (schedules.py:259) and DDP sums over DP instead of
    # averaging (distributed_data_parallel.py:254-259).
    kwargs["calculate_per_token_loss"] = True
    if te_fp8_recipe is not None:
        from megatron_rl.fp8.te_recipe import megatron_fp8_kwargs

        kwargs.update(megatron_fp8_kwargs(te_fp8_recipe))
    return TransformerConfig(**kwargs)


def build_model(spec: ModelSpec, config, parallel: ParallelInfo, *, fp8_recipe: Any = None,
                use_te: bool = False, seed: int = 0) -> torch.nn.Module:
    """This PP stage's GPTModel, wrapped in Megatron DDP (gradient buffers + DP all-reduce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    layer_spec = build_layer_spec(spec, fp8_recipe=fp8_recipe, use_te=use_te)
    model = GPTModel(config, layer_spec, pre_process=parallel.is_first_stage,
                     post_process=parallel.is_last_stage, **gpt_model_kwargs(spec))
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
    return DistributedDataParallel(config, ddp_config, model)


def build_optimizer(model_chunks: list[torch.nn.Module], *, lr: float, weight_decay: float,
                    adam_betas: tuple[float, float], bf16: bool):
    """Megatron's optimizer over the DDP chunks (Adam = torch AdamW without TE/apex).

    clip_grad stays 0 here: the actor clips after its own finite-norm check (actor._step).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if lr < 0 or weight_decay < 0:
        raise ValueError(f"lr={lr} and weight_decay={weight_decay} must be >= 0")
    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay,
                             adam_beta1=adam_betas[0], adam_beta2=adam_betas[1], bf16=bf16,
                             params_dtype=torch.bfloat16 if bf16 else torch.float32,
                             clip_grad=0.0, use_distributed_optimizer=False)
    return get_megatron_optimizer(config, model_chunks)


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (the trainer owns the schedule)."""
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr={lr} must be finite and >= 0")
    for group in optimizer.param_groups:
        group["lr"] = lr


def get_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
