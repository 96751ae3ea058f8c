"""MegatronActor: a Megatron-Core GPT policy with HF weight load/export, log-probs and train steps.

    par = init_parallel(tp=2, pp=1)
    actor = MegatronActor.build(hf_dir, parallel=par, lr=1e-6)        # config + weights
    out = actor.compute_logprobs(batch, micro_batch_size=4)          # {"logprobs", "entropy"} [B, S]
    stats = actor.train_step(batch, loss_fn, micro_batch_size=4)     # grad_norm, lr, metrics
    for hf_name, tensor in actor.export_hf_weights(): ...            # full tensors, this PP stage

See docs/actor.md for the batch format and the loss_fn contract.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.actor import build as _build
from megatron_rl.actor import outliers, weights
from megatron_rl.actor.batch import split_micro_batches, validate_batch
from megatron_rl.actor.forward import LossFn, compute_device, make_forward_step, unwrap_model
from megatron_rl.actor.offload import StorageOffloader
from megatron_rl.actor.parallel import ParallelInfo
from megatron_rl.actor.schedule import LRSchedule, build_scheduler
from megatron_rl.actor.settings import ResolvedSettings, plain_settings
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.models.hf_config import ModelSpec
from megatron_rl.models.layer_spec import te_available
from megatron_rl.models.rope import rope_inv_freq


class MegatronActor:
    """One rank's share (a TP shard of one PP stage) of the policy, its optimizer and its I/O."""

    def __init__(self, spec: ModelSpec, parallel: ParallelInfo, model: list[torch.nn.Module],
                 optimizer, config, *, clip_grad: float, fp8_recipe: Any = None,
                 use_te: bool = False, settings: ResolvedSettings | None = None) -> None:
        self.spec = spec
        self.parallel = parallel
        self.model = model
        """Model chunks (one per virtual stage; one here), each a Megatron DDP wrapper."""
        self.optimizer = optimizer
        self.config = config
        self.clip_grad = clip_grad
        self.fp8_recipe = fp8_recipe
        self.use_te = use_te
        self.settings = settings or plain_settings(parallel.tp_size, parallel.pp_size)
        self.inv_freq = rope_inv_freq(spec)
        self.layer_offset = _layer_offset(config, parallel)
        self._params = weights.global_params(model, self.layer_offset)
        self._offloader = StorageOffloader()
        self.scheduler = None
        """Megatron's OptimizerParamScheduler, set by build(): lr and weight decay per param group."""

    @classmethod
    def build(cls, spec_or_hf_dir: ModelSpec | str | Path, *, parallel: ParallelInfo,
              fp8_recipe: Any = None, lr: float = 1e-5, weight_decay: float = 0.0,
              adam_betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
              lr_schedule: LRSchedule | None = None, clip_grad: float = 1.0, seed: int = 0, params_dtype: torch.dtype = torch.float32,
              use_te: bool | None = None, load_weights: bool = True,
              settings: ResolvedSettings | None = None, frozen: bool = False) -> "MegatronActor":
        """Build this rank's model stage and optimizer.

        Args:
            spec_or_hf_dir: a ModelSpec (random init from `seed`), or a HF folder: its config, and
                its safetensors weights unless load_weights=False.
            parallel: from init_parallel().
            lr_schedule: warm-up and decay of `lr` (None: constant); advance_lr_schedule() steps it.
            clip_grad: max global grad norm (0 disables clipping; the norm is still reported).
            use_te: force the TE / local layer spec (default: TE when it imports and CUDA is on).
            settings: resolve_settings() of a run config (params dtype, layer spec, distributed
                optimizer, SP, recompute); it overrides params_dtype and use_te. None: plain
                settings (every scale feature off) from params_dtype and use_te.
            frozen: forward only (a reference policy): no DDP wrapper, gradient buffers,
                optimizer or schedule; parameters do not require grad; train_step refuses.
        """
        if clip_grad < 0 or not math.isfinite(clip_grad):
            raise ValueError(f"clip_grad={clip_grad} must be finite and >= 0")
        is_dir = not isinstance(spec_or_hf_dir, ModelSpec)
        spec = ModelSpec.from_hf_config(spec_or_hf_dir) if is_dir else spec_or_hf_dir
        if settings is None:
            settings = _settings_from_args(parallel, params_dtype, use_te)
        use_te = settings.transformer_impl == "transformer_engine"
        te_fp8 = fp8_recipe if use_te and fp8_recipe is not None and fp8_recipe.enabled else None
        config = _build.build_transformer_config(spec, parallel, settings, te_fp8)
        model = [_build.build_model(spec, config, parallel, settings, fp8_recipe=fp8_recipe,
                                    seed=seed, ddp=not frozen)]
        lr_schedule, optimizer = lr_schedule or LRSchedule(), None
        if frozen:
            model[0].requires_grad_(False)
        else:
            optimizer = _build.build_optimizer(model, settings, lr=lr, weight_decay=weight_decay, adam_betas=adam_betas,
                                               adam_eps=adam_eps, min_lr=lr_schedule.min_lr)
            _wire_schedule_hooks(config, model)
        actor = cls(spec, parallel, model, optimizer, config, clip_grad=clip_grad,
                    fp8_recipe=fp8_recipe, use_te=use_te, settings=settings)
        if not frozen:
            actor.scheduler = build_scheduler(optimizer, lr=lr, weight_decay=weight_decay, schedule=lr_schedule)
        if is_dir and load_weights:
            actor.load_hf(spec_or_hf_dir)
        return actor

    # ---- weights -------------------------------------------------------------------------

    def load_hf(self, hf_dir: str | Path) -> None:
        """Load this rank's shards from a HF safetensors folder (single file or sharded index).

        Raises ValueError naming a missing folder, a missing tensor or a wrongly shaped one.
        """
        ckpt = HFCheckpoint(hf_dir)
        names = weights.needed_hf_names(self._params, self.spec)
        missing = [n for n in names if n not in ckpt]
        if missing:
            raise ValueError(f"missing tensor(s) in {hf_dir}: {missing[:8]}")
        self.load_hf_state_dict(ckpt.iter_tensors(names))

    def load_hf_state_dict(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict) -> None:
        """Load from HF-named FULL tensors (a dict or (name, tensor) pairs); others' stages ignored."""
        if isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        weights.load_hf_tensors(self._params, named_tensors, self.spec, self.parallel)
        self._reload_main_params()

    def plant_outliers(self, num_channels: int, scale: float, seed: int) -> list[int]:
        """Plant activation outliers (actor/outliers.py) in this rank's weights; returns the channels.

        The model's function is unchanged; run it once, on a fresh start (a checkpoint holds the
        planted weights already)."""
        channels = outliers.choose_outlier_channels(self.spec.hidden_size, num_channels, seed)
        outliers.plant_outliers(self._params, channels, scale)
        self._reload_main_params()
        return channels

    def finish_param_sync(self) -> None:
        """Complete the distributed optimizer's parameter all-gather before weights are read
        outside a forward (export, weight sync, checkpoint). With overlap_param_gather the step
        leaves it to the next forward's pre-hooks (distributed_data_parallel.py:384-418), so until
        then each rank holds fresh values only for its own shard."""
        if self.settings.overlap_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def _reload_main_params(self) -> None:
        """After writing model weights: the FP32 main params (BF16 mixed precision, distributed
        optimizer) are copies taken when the optimizer was built; refresh them from the model."""
        if self.optimizer is not None and (self.settings.bf16 or self.settings.use_distributed_optimizer):
            self.optimizer.reload_model_params()

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors of this PP stage, TP shards all-gathered one parameter at a time.

        Collective over the TP group: every TP rank must consume the whole iterator.
        """
        self.finish_param_sync()
        return weights.export_hf_tensors(self._params, self.spec, self.parallel)

    # ---- forward / backward --------------------------------------------------------------

    def compute_logprobs(self, batch: dict, *, micro_batch_size: int, with_entropy: bool = True,
                         fp8: bool = True, logprob_chunk_size: int = 0) -> dict[str, torch.Tensor]:
        """Per-token log-probs (and entropy) [B, S] float32 without grad, on every rank.

        logprobs[:, t] = log p(tokens[:, t] | tokens[:, :t]); 0 at t = 0 and at the first token of
        each packed sequence. fp8=False runs the BF16 shadow (quantization off).
        logprob_chunk_size > 0: only loss-mask tokens, that many at a time (0 elsewhere).
        """
        self._validate(batch, micro_batch_size)
        micro_batches = split_micro_batches(batch, micro_batch_size)
        step = make_forward_step(self.inv_freq, self.parallel.tp_group, None, with_entropy,
                                 logprob_chunk_size, thd=self.use_te)
        for chunk in self.model:
            chunk.eval()
        with torch.no_grad(), _precision(self.config, fp8):
            outputs = self._run_schedule(step, micro_batches, forward_only=True)
        shape = tuple(batch["tokens"].shape)
        result = {"logprobs": self._from_last_stage(outputs, "logprobs", shape)}
        if with_entropy:
            result["entropy"] = self._from_last_stage(outputs, "entropy", shape)
        return result

    def train_step(self, batch: dict, loss_fn: LossFn, *, micro_batch_size: int,
                   logprob_chunk_size: int = 0) -> dict[str, Any]:
        """Forward/backward over micro-batches (gradient accumulation), then one optimizer step.

        loss_fn(logprobs [b, S], entropy [b, S], micro_batch) -> (loss, metrics): loss a scalar
        already divided by the GLOBAL denominator (gradients are those of the plain sum of the
        micro-batch losses, summed over DP ranks); metrics values float64 [2] (numerator, denominator).
        Returns {"grad_norm", "lr", "loss" (sum over micro-batches), "metrics" (list per
        micro-batch), "skipped" (non-finite grad norm: no update)} on every rank.
        logprob_chunk_size > 0: log-probs / entropy of loss-mask tokens only, in chunks, recomputed
        in backward (0 elsewhere).
        """
        if self.optimizer is None:
            raise ValueError("train_step on a frozen actor (built with frozen=True: a reference policy)")
        self._validate(batch, micro_batch_size)
        micro_batches = split_micro_batches(batch, micro_batch_size)
        step = make_forward_step(self.inv_freq, self.parallel.tp_group, loss_fn,
                                 logprob_chunk_size=logprob_chunk_size, thd=self.use_te)
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(step, micro_batches, forward_only=False)
        grad_norm, updated = self._optimizer_step()
        reduced = self._objects_from_last_stage(
            [{"loss": o["loss"].cpu(), "metrics": {k: v.cpu() for k, v in o["metrics"].items()}}
             for o in outputs])
        return {"grad_norm": grad_norm, "lr": self.lr, "skipped": not updated,
                "loss": float(sum(float(r["loss"]) for r in reduced)),
                "metrics": [r["metrics"] for r in reduced]}

    def _validate(self, batch: dict, micro_batch_size: int) -> None:
        validate_batch(batch, self.spec.vocab_size, micro_batch_size)
        if self.use_te and "seq_lens" in batch and micro_batch_size != 1:
            # THD packing (TE spec) runs one packed row per micro-batch.
            raise ValueError(f"batch['seq_lens'] (packed rows) with the TE spec needs "
                             f"micro_batch_size=1, got {micro_batch_size}")
        seq_len, tp = batch["tokens"].shape[1], self.parallel.tp_size
        if self.settings.sequence_parallel and seq_len % tp:
            # SP splits the sequence over the TP ranks (mappings.py scatter along dim 0).
            raise ValueError(f"batch['tokens'] has {seq_len} tokens per row: sequence parallel "
                             f"needs a multiple of tensor_model_parallel_size={tp}; pad the rows")

    def _run_schedule(self, forward_step, micro_batches: list[dict], forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rows, seq_len = micro_batches[0]["tokens"].shape
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=self.model,
            num_microbatches=len(micro_batches), seq_length=seq_len, micro_batch_size=rows,
            forward_only=forward_only)

    def _optimizer_step(self) -> tuple[float, bool]:
        """Megatron's step with a finite-norm check in front: a NaN/Inf gradient skips the update."""
        from megatron.core.optimizer import optimizer as megatron_optimizer

        opt = self.optimizer
        found_inf = opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            opt.zero_grad()
            return grad_norm, False
        if self.clip_grad > 0:
            # Module attribute looked up at call time: the CPU layer may have replaced it.
            megatron_optimizer.clip_grad_by_total_norm_fp32(
                opt.get_parameters(), self.clip_grad, grad_norm)
        return grad_norm, bool(opt.step_with_ready_grads())

    # ---- pipeline broadcast --------------------------------------------------------------

    def _from_last_stage(self, outputs: list[dict], key: str, shape: tuple[int, int]) -> torch.Tensor:
        par = self.parallel
        if par.is_last_stage:
            result = torch.cat([o[key] for o in outputs], dim=0).float().contiguous()
        else:
            result = torch.empty(shape, dtype=torch.float32, device=compute_device())
        if par.pp_size > 1:
            # PP group: the last stage holds the outputs; every stage returns them.
            dist.broadcast(result, src=par.last_stage_rank, group=par.pp_group)
        return result.cpu()

    def _objects_from_last_stage(self, objects: list) -> list:
        par = self.parallel
        if par.pp_size == 1:
            return objects
        box = [objects if par.is_last_stage else None]
        dist.broadcast_object_list(box, src=par.last_stage_rank, group=par.pp_group)
        return box[0]

    # ---- colocated offload ---------------------------------------------------------------

    def offload(self, groups: tuple[str, ...] = ("grads", "optimizer", "params")) -> int:
        """Free this rank's device memory of `groups` (copies kept in pinned host memory);
        returns the bytes freed. Nothing may touch the offloaded tensors until `reload`."""
        return self._offloader.offload(t for group in groups for t in self._state_tensors(group))

    def reload(self) -> int:
        """Bring back everything `offload` freed, bitwise; returns the bytes."""
        return self._offloader.reload()

    def _state_tensors(self, group: str) -> list[torch.Tensor]:
        params = [p for chunk in self.model for p in chunk.parameters()]
        if group == "params":
            return params
        if group == "grads":
            return [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
        if group == "optimizer":
            # FP32 master copies (mixed precision) and Adam moments; with FP32 weights the optimizer's
            # parameters are the model's own, which belong to "params".
            own = {p.untyped_storage().data_ptr() for p in params}
            masters = [p for g in self.optimizer.param_groups for p in g["params"]
                       if p.untyped_storage().data_ptr() not in own]
            moments = [t for _, state in self.optimizer.state.items() for t in state.values()
                       if torch.is_tensor(t)]
            return masters + moments
        raise ValueError(f"offload group {group!r} is not one of ('grads', 'optimizer', 'params')")

    # ---- state ---------------------------------------------------------------------------

    @property
    def lr(self) -> float:
        return _build.get_lr(self.optimizer)

    def set_lr(self, lr: float) -> None:
        _build.set_lr(self.optimizer, lr)

    def advance_lr_schedule(self) -> float:
        """One step of the learning-rate schedule (Megatron's OptimizerParamScheduler); the new lr."""
        self.scheduler.step(increment=1)
        return self.lr

    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        """Model + optimizer sharded state dict for megatron.core.dist_checkpointing.

        is_loading=True makes the optimizer allocate its (still empty) Adam state first: a fresh
        optimizer has no exp_avg / exp_avg_sq yet, and without placeholders they are not loaded.
        """
        model_sd = unwrap_model(self.model[0]).sharded_state_dict(prefix="")
        if is_loading:
            _build.materialize_adam_state(self.optimizer)
        metadata = None
        if self.settings.use_distributed_optimizer:
            # dp_reshardable: each rank writes its own optimizer shard (no gather; fully parallel)
            # and a load at another DP size re-slices it (distrib_optimizer.py:1539-1580). The
            # default model-space format needs flattened ShardedTensors, which 0.16 refuses.
            metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=metadata)}

    def save_checkpoint(self, ckpt_dir: str | Path, *, async_save: bool = False):
        """Megatron distributed checkpoint of model + optimizer into an existing empty folder
        (collective over all ranks; the caller makes it atomic by writing then renaming).

        Fully parallel: the replicas of each tensor (over DP) split the writing between them.
        async_save=True returns Megatron's AsyncRequest, else None. The caller schedules it before
        the weights change again: scheduling stages the tensors (a device-to-host copy, or on
        the CPU the fork of the writer process) and the writer works from that copy.
        """
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        self.finish_param_sync()
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                                    self.parallel.dp_group)
        return dist_checkpointing.save(self.sharded_state_dict(), str(ckpt_dir),
                                       sharded_strategy=strategy, async_sharded_save=async_save)

    def _load_strategy(self, ckpt_dir: str | Path):
        """Fully parallel load: the DP replicas read disjoint parts and exchange them."""
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(ckpt_dir)),
                                                self.parallel.dp_group)

    def load_checkpoint(self, ckpt_dir: str | Path, *, model_only: bool = False) -> None:
        """Restore model + optimizer from `save_checkpoint` (any TP/PP layout Megatron can reshard).

        model_only=True loads the weights alone (the optimizer starts fresh), e.g. from
        tools/convert_hf_to_megatron.py. FP8 delayed-scaling buffers (`fp8_state`) and module extra
        state missing from such a checkpoint start fresh; any other missing tensor is a ValueError
        naming it.
        """
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

        if not Path(ckpt_dir).is_dir():
            raise ValueError(f"checkpoint folder not found: {ckpt_dir}")
        if not model_only:
            state = dist_checkpointing.load(self.sharded_state_dict(is_loading=True), str(ckpt_dir),
                                            sharded_strategy=self._load_strategy(ckpt_dir))
            unwrap_model(self.model[0]).load_state_dict(state["model"])
            with torch.no_grad():  # FP32 params: the distributed optimizer's shards are views
                self.optimizer.load_state_dict(state["optimizer"])  # of the model's leaves
            return
        wanted = unwrap_model(self.model[0]).sharded_state_dict(prefix="")
        stored = load_sharded_metadata(str(ckpt_dir))
        missing = [k for k, v in wanted.items() if getattr(v, "key", k) not in stored]
        fatal = [k for k in missing if ".fp8_state." not in k and not k.endswith("._extra_state")]
        if fatal:
            raise ValueError(f"checkpoint {ckpt_dir} lacks {len(fatal)} model tensors, first: {fatal[:3]}")
        state = dist_checkpointing.load({k: v for k, v in wanted.items() if k not in missing}, str(ckpt_dir))
        unwrap_model(self.model[0]).load_state_dict(state, strict=not missing)
        self._reload_main_params()

def _settings_from_args(parallel: ParallelInfo, params_dtype: torch.dtype,
                        use_te: bool | None) -> ResolvedSettings:
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if params_dtype not in names:
        raise ValueError(f"params_dtype={params_dtype} is not supported (float32 or bfloat16)")
    use_te = te_available() if use_te is None else use_te
    return plain_settings(parallel.tp_size, parallel.pp_size, params_dtype=names[params_dtype],
                          transformer_impl="transformer_engine" if use_te else "local",
                          cuda=torch.cuda.is_available())


def _layer_offset(config, parallel: ParallelInfo) -> int:
    """Global index of this stage's first layer (layers split evenly over PP stages)."""
    return parallel.pp_rank * (config.num_layers // parallel.pp_size)


def _wire_schedule_hooks(config, model: list[torch.nn.Module]) -> None:
    """What Megatron's training loop sets on the config before forward_backward_func."""
    from megatron.core.distributed import finalize_model_grads

    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = None  # fp32/bf16 here: no loss scaling


@contextlib.contextmanager
def _precision(config, fp8: bool):
    """fp8=False: the BF16 shadow. Emulated FP8 linears follow megatron_rl.fp8.fp8_disabled();
    with the TE spec Megatron enters TE's fp8_autocast from config.fp8 at every forward
    (fp8_utils.get_fp8_context), so it is cleared for the block and restored after."""
    if fp8:
        yield
        return
    from megatron_rl.fp8 import fp8_disabled

    saved = config.fp8
    config.fp8 = None
    try:
        with fp8_disabled():
            yield
    finally:
        config.fp8 = saved
