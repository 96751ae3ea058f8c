"""Build the actor's Megatron pieces: TransformerConfig, GPTModel stage wrapped in DDP, optimizer."""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_rl.actor.parallel import ParallelInfo
from megatron_rl.actor.settings import ResolvedSettings
from megatron_rl.models.hf_config import ModelSpec, gpt_model_kwargs, transformer_config_kwargs
from megatron_rl.models.layer_spec import build_block_spec, build_layer_spec

PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_transformer_config(spec: ModelSpec, parallel: ParallelInfo, settings: ResolvedSettings,
                             te_fp8_recipe: Any = None):
    """TransformerConfig of the actor; te_fp8_recipe (TE spec only) sets Megatron's fp8 fields.

    Weights are always initialized, even when a checkpoint overwrites them next: with
    perform_initialization=False Megatron also skips tagging TP-sharded weights
    (tensor_model_parallel, partition_dim; tensor_parallel/layers.py:855-884), and the grad norm
    then drops the shards of every TP rank but the first.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = transformer_config_kwargs(spec, tp=parallel.tp_size, pp=parallel.pp_size,
                                       params_dtype=PARAMS_DTYPES[settings.params_dtype])
    # The loss handed to the schedule already carries the GLOBAL denominator (the loss_fn's
    # contract). calculate_per_token_loss=True is Megatron's switch for that: the schedule does
    # not divide by num_microbatches (schedules.py:259) and DDP sums over DP instead of
    # averaging (distributed_data_parallel.py:254-259).
    kwargs["calculate_per_token_loss"] = True
    kwargs.update(scale_kwargs(spec, parallel, settings))
    if te_fp8_recipe is not None:
        from megatron_rl.fp8.te_recipe import megatron_fp8_kwargs

        kwargs.update(megatron_fp8_kwargs(te_fp8_recipe))
    return TransformerConfig(**kwargs)


def scale_kwargs(spec: ModelSpec, parallel: ParallelInfo, settings: ResolvedSettings) -> dict:
    """TransformerConfig fields for sequence parallel, recompute and the GPU fusions."""
    kwargs: dict[str, Any] = {"sequence_parallel": settings.sequence_parallel}
    if settings.recompute_granularity != "none":
        kwargs["recompute_granularity"] = settings.recompute_granularity
    if settings.recompute_granularity == "full":
        stage_layers = spec.num_layers // parallel.pp_size
        if settings.recompute_num_layers > stage_layers:
            raise ValueError(f"config key 'parallel.recompute_num_layers': "
                             f"{settings.recompute_num_layers} > {stage_layers} layers per stage")
        kwargs["recompute_method"] = settings.recompute_method
        kwargs["recompute_num_layers"] = settings.recompute_num_layers
    if settings.device == "cuda" and settings.transformer_impl == "transformer_engine":
        # The fused kernels exist on CUDA with TE. The wgrad fusion also needs apex (settings.py).
        # RoPE fusion stays off: the actor's angles are per token (models/rope.py).
        kwargs.update(gradient_accumulation_fusion=settings.gradient_accumulation_fusion,
                      bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=True)
    return kwargs


def build_model(spec: ModelSpec, config, parallel: ParallelInfo, settings: ResolvedSettings, *,
                fp8_recipe: Any = None, seed: int = 0, ddp: bool = True) -> torch.nn.Module:
    """This PP stage's GPTModel (in Float16Module under bf16), wrapped in Megatron DDP (gradient
    buffers in FP32, reduced over DP: all-reduce, or reduce-scatter with the distributed optimizer).
    ddp=False: no wrapper and no gradient buffers (a forward-only model)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    use_te = settings.transformer_impl == "transformer_engine"
    layer_spec = build_layer_spec(spec, fp8_recipe=fp8_recipe, use_te=use_te)
    model = GPTModel(config, build_block_spec(layer_spec, config, use_te), pre_process=parallel.is_first_stage,
                     post_process=parallel.is_last_stage, **gpt_model_kwargs(spec))
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if not ddp:
        return model
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=settings.overlap_param_gather,
        use_distributed_optimizer=settings.use_distributed_optimizer)
    return DistributedDataParallel(config, ddp_config, model)


def build_optimizer(model_chunks: list[torch.nn.Module], settings: ResolvedSettings, *, lr: float,
                    weight_decay: float, adam_betas: tuple[float, float], adam_eps: float = 1e-8,
                    min_lr: float | None = None):
    """Megatron's optimizer over the DDP chunks (Adam = torch AdamW without TE/apex): FP32Optimizer,
    or under bf16 the mixed-precision one (FP32 main params), or the distributed optimizer.

    clip_grad stays 0 here: the actor clips after its own finite-norm check (actor._step).
    min_lr (None: lr) lands in every param group, where the scheduler reads it (actor/schedule.py).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    min_lr = lr if min_lr is None else min_lr
    if lr < 0 or weight_decay < 0 or not 0 <= min_lr <= lr:
        raise ValueError(f"lr={lr}, weight_decay={weight_decay} must be >= 0 and min_lr={min_lr} in [0, lr]")
    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay,
                             adam_beta1=adam_betas[0], adam_beta2=adam_betas[1], adam_eps=adam_eps,
                             bf16=settings.bf16,
                             params_dtype=PARAMS_DTYPES[settings.params_dtype], clip_grad=0.0,
                             use_distributed_optimizer=settings.use_distributed_optimizer,
                             overlap_param_gather=settings.overlap_param_gather)
    return get_megatron_optimizer(config, model_chunks)


def materialize_adam_state(optimizer) -> None:
    """Give every parameter of a fresh optimizer zero Adam state, `step` included, before a load.

    Without TE/apex the distributed optimizer reads the step out of torch Adam's per-param state
    (distrib_optimizer.py:640-643, an assert that it exists); Megatron's init_state_fn only makes
    exp_avg / exp_avg_sq. The checkpoint then overwrites all of it in place.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue  # TE / apex FusedAdam keep the step in param_groups: nothing to add
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group (the trainer owns the schedule)."""
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr={lr} must be finite and >= 0")
    for group in optimizer.param_groups:
        group["lr"] = lr


def get_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
