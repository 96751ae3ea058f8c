"""The `parallel` section: TP / PP / CP / DP layout, recompute, the host-side waits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.actor.settings import validate_parallel

if TYPE_CHECKING:
    from megatron_rl.config.run import RunConfig


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    """Data-parallel size is world_size / (tp * pp * cp)."""
    context_parallel_size: int = 1
    """Context parallel (sequence split across ranks for attention); 1 = off."""
    sequence_parallel: bool | None = None
    """true | false | null (auto). Megatron sequence parallel (norms, dropout and the residual stream split
    along the sequence over the TP group). null: on whenever TP > 1 on a GPU, off on CPU."""
    use_distributed_optimizer: bool | None = None
    """true | false | null (auto). Megatron's distributed optimizer (optimizer state and FP32 main
    parameters sharded over DP, as ZeRO-1). null: on when the trainer runs on GPUs."""
    overlap_grad_reduce: bool | None = None
    """true | false | null (auto). Overlap the DP gradient reduce-scatter with backward. null: on on GPUs."""
    overlap_param_gather: bool | None = None
    """true | false | null (auto). Overlap the distributed optimizer's parameter all-gather with the next
    forward. null: on on GPUs (needs use_distributed_optimizer)."""
    recompute_granularity: str = "none"
    """none | selective (attention core only) | full (whole layers; see recompute_method)."""
    recompute_method: str = "uniform"
    """uniform | block: how full recompute picks layers (Megatron's --recompute-method)."""
    recompute_num_layers: int = 1
    """Full recompute: layers per recompute chunk (uniform) or recomputed layers per stage (block)."""
    transformer_impl: str = "auto"
    """auto | transformer_engine | local. auto: Transformer Engine's layer spec on CUDA (required;
    an import failure is an error, not a silent fallback), the local spec with emulated FP8 on CPU."""
    host_wait_timeout_s: float = 0.0
    """Seconds, timeout of the gloo groups that carry the long waits (server start, a whole rollout,
    an evaluation, the owners' weight update); they never wait on the default NCCL group, whose
    watchdog ends the job after 10 minutes. 0 = sized to the job: rollout.sglang.startup_timeout_s +
    (max_retries + 1) x request_timeout_s + 600 (4.4 h with the defaults); 7200 with the embedded engine."""


CHOICES = {
    "recompute_granularity": ("none", "selective", "full"),
    "recompute_method": ("uniform", "block"),
    "transformer_impl": ("auto", "transformer_engine", "local"),
}
POSITIVE = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "recompute_num_layers")


def check_layout(cfg: RunConfig) -> None:
    """The device-independent rules of the layout (CP, sequence parallel, the optimizer's overlap),
    kept next to the trainer that relies on them (actor/settings.py)."""
    validate_parallel(cfg)


def check_host_wait(cfg: RunConfig) -> None:
    t = cfg.parallel.host_wait_timeout_s
    sg = cfg.rollout.sglang
    if t < 0:
        raise ValueError(f"config key 'parallel.host_wait_timeout_s': must be >= 0 (0 = sized to the job), got {t}")
    if t and cfg.rollout.engine == "sglang" and t < sg.startup_timeout_s:
        raise ValueError(f"config key 'parallel.host_wait_timeout_s': {t} s is shorter than a server start "
                         f"(rollout.sglang.startup_timeout_s={sg.startup_timeout_s}): the other ranks would "
                         "give up while the owners' servers still start")
