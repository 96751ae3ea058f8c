"""The actor's resolved GPU-scale settings: config `null`/`auto` turned into concrete choices.

One pure function, `resolve_settings(cfg, cuda)`, importable without Megatron, Transformer Engine
or a GPU: the actor builds from its result and the memory planner sizes from the same result, so
the two can never disagree about what a config means. Cross-field mistakes are refused here with a
ValueError naming the key.

    s = resolve_settings(cfg, cuda=torch.cuda.is_available())
    s.params_dtype            # "bf16" | "fp32"
    s.use_distributed_optimizer, s.sequence_parallel, s.recompute_granularity, s.transformer_impl
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The CPU default of precision.params_dtype=auto. BF16 works on CPU (the tiny demo learns as in
# FP32) and is faster where the CPU has BF16 instructions (AVX512-BF16: 0.63x the step CPU time,
# tools/bench/actor_step.py), but that speed is machine-dependent and the reproduction numbers
# were measured in FP32, so FP32 stays the default; every run records its dtype
# (actor_settings.json, the start line). docs/actor.md has the measurements.
CPU_PARAMS_DTYPE = "fp32"

# Recipes Transformer Engine has no recipe object for: the actor runs them emulated (local spec).
EMULATED_ONLY_RECIPES = ("rowwise",)

# MXFP8 (1x32 blocks, E8M0 scales) and NVFP4 run natively on Blackwell only (compute capability
# 10.x): TE's kernels for both need sm100 tensor cores.
MXFP8_MIN_CAPABILITY = (10, 0)
NVFP4_MIN_CAPABILITY = (10, 0)
# Recipes with no TE recipe that are not worth running emulated on a GPU either: CPU only.
CPU_ONLY_RECIPES = ("mxfp4",)


@dataclass(frozen=True)
class ResolvedSettings:
    """What the actor runs with. Every field is concrete (no None/auto left)."""

    device: str
    """cuda | cpu."""
    params_dtype: str
    """bf16 | fp32: parameter dtype; bf16 means Float16Module + FP32 main params and grads."""
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    sequence_parallel: bool
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    recompute_granularity: str
    """none | selective | full."""
    recompute_method: str
    recompute_num_layers: int
    transformer_impl: str
    """transformer_engine | local."""
    fp8_emulated: bool
    """True when an FP8 train recipe runs through the emulated linears (local spec) instead of TE."""
    gradient_accumulation_fusion: bool = False
    """Megatron's fused wgrad accumulation into main_grad. On only on CUDA with the TE spec and when
    apex's fused_weight_gradient_mlp_cuda imports: Megatron's own ColumnParallelLinear (the output
    layer, also under the TE spec) raises at construction without it (megatron-core 0.16.1
    tensor_parallel/layers.py:44-48, 924-933), and nothing installs apex."""

    @property
    def bf16(self) -> bool:
        return self.params_dtype == "bf16"

    @property
    def bytes_per_param(self) -> int:
        """Bytes of one model parameter (the FP32 main copy and grads are separate, in the optimizer)."""
        return 2 if self.bf16 else 4

    def summary(self, train_recipe: str, dp_size: int) -> str:
        """The one start line: what runs where (device, dtype, FP8 recipe real or emulated, grid,
        optimizer, recompute, layer spec)."""
        if train_recipe == "bf16":
            fp8 = "fp8=off"
        else:
            fp8 = f"fp8={train_recipe}({'emulated' if self.fp8_emulated else 'TE'})"
        optimizer = "distributed-adam" if self.use_distributed_optimizer else "adam"
        return (f"actor: {self.device} params={self.params_dtype} {fp8} "
                f"TP={self.tensor_model_parallel_size} PP={self.pipeline_model_parallel_size} "
                f"DP={dp_size} SP={'on' if self.sequence_parallel else 'off'} "
                f"optimizer={optimizer} recompute={self.recompute_granularity} "
                f"layers={self.transformer_impl}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _auto(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def _transformer_impl(cfg, cuda: bool) -> tuple[str, bool]:
    """(transformer_impl, fp8_emulated) from parallel.transformer_impl and the recipe."""
    impl, recipe = cfg.parallel.transformer_impl, cfg.precision.train_recipe
    if impl == "transformer_engine" and not cuda:
        raise ValueError("config key 'parallel.transformer_impl': 'transformer_engine' needs CUDA; "
                         "use 'auto' or 'local' on CPU")
    if cuda and recipe in CPU_ONLY_RECIPES:
        raise ValueError(f"config key 'precision.train_recipe': {recipe!r} has no Transformer Engine "
                         "recipe (TE trains FP4 only as nvfp4); it is a CPU emulation stress level. "
                         "Use nvfp4 on Blackwell, or run on CPU")
    if impl == "transformer_engine" and recipe in EMULATED_ONLY_RECIPES:
        raise ValueError(f"config key 'precision.train_recipe': {recipe!r} has no Transformer "
                         "Engine recipe; set parallel.transformer_impl=local (or auto) to run it "
                         "emulated, or choose blockwise / tensorwise / delayed")
    if impl == "auto":
        # rowwise on CUDA runs emulated on purpose (local spec), and the start banner says so.
        impl = "transformer_engine" if cuda and recipe not in EMULATED_ONLY_RECIPES else "local"
    return impl, recipe != "bf16" and impl == "local"


def _params_dtype(cfg, cuda: bool) -> str:
    dtype = cfg.precision.params_dtype
    if dtype == "auto":
        return "bf16" if cuda else CPU_PARAMS_DTYPE
    return dtype


def validate_parallel(cfg) -> None:
    """The device-independent cross-field rules of the `parallel` section (config.validate)."""
    p = cfg.parallel
    if p.context_parallel_size > 1:
        raise ValueError(f"config key 'parallel.context_parallel_size': {p.context_parallel_size} "
                         "is not supported (context parallel needs THD packing, TE attention and "
                         "RoPE sliced per CP rank, not built yet); use 1")
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        raise ValueError("config key 'parallel.sequence_parallel': sequence parallel splits over "
                         "the TP group; it needs parallel.tensor_model_parallel_size > 1")
    if p.overlap_param_gather and p.use_distributed_optimizer is False:
        raise ValueError("config key 'parallel.overlap_param_gather': the parameter all-gather "
                         "exists only with the distributed optimizer; set "
                         "parallel.use_distributed_optimizer=true or overlap_param_gather=false")


def resolve_settings(cfg, cuda: bool, wgrad_fusion: bool = False) -> ResolvedSettings:
    """Resolve the actor's null/auto config keys for a machine with (cuda=True) or without a GPU.

    Args:
        cfg: a RunConfig (only its `parallel` and `precision` sections are read).
        cuda: whether the trainer runs on CUDA devices.
        wgrad_fusion: whether apex's fused wgrad kernel imports (fp8.te_recipe.wgrad_fusion_available).
    Raises:
        ValueError naming the config key of a combination that cannot run.
    """
    validate_parallel(cfg)
    p = cfg.parallel
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    dist_opt = _auto(p.use_distributed_optimizer, cuda)
    if p.overlap_param_gather and not dist_opt:
        raise ValueError("config key 'parallel.overlap_param_gather': the parameter all-gather "
                         "exists only with the distributed optimizer, which is off by default on "
                         "CPU; set parallel.use_distributed_optimizer=true")
    impl, emulated = _transformer_impl(cfg, cuda)
    return ResolvedSettings(
        device="cuda" if cuda else "cpu", params_dtype=_params_dtype(cfg, cuda),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        sequence_parallel=_auto(p.sequence_parallel, cuda and tp > 1),
        use_distributed_optimizer=dist_opt,
        overlap_grad_reduce=_auto(p.overlap_grad_reduce, cuda),
        overlap_param_gather=_auto(p.overlap_param_gather, cuda and dist_opt),
        recompute_granularity=p.recompute_granularity, recompute_method=p.recompute_method,
        recompute_num_layers=p.recompute_num_layers, transformer_impl=impl, fp8_emulated=emulated,
        gradient_accumulation_fusion=cuda and impl == "transformer_engine" and wgrad_fusion)


def check_device(settings: ResolvedSettings, recipe: str,
                 capability: tuple[int, int] | None) -> None:
    """Refuse an FP8 recipe the device cannot run natively (build time, once the GPU is known).

    capability: torch.cuda.get_device_capability(), None on CPU (everything is emulated there).
    """
    if capability is None or settings.transformer_impl != "transformer_engine":
        return
    if recipe == "mxfp8" and tuple(capability) < MXFP8_MIN_CAPABILITY:
        raise ValueError(f"config key 'precision.train_recipe': 'mxfp8' needs a Blackwell GPU "
                         f"(compute capability 10.x), this device is {capability[0]}.{capability[1]}; "
                         "use blockwise on Hopper")
    if recipe == "nvfp4" and tuple(capability) < NVFP4_MIN_CAPABILITY:
        raise ValueError(f"config key 'precision.train_recipe': 'nvfp4' needs a Blackwell GPU "
                         f"(compute capability 10.x), this device is {capability[0]}.{capability[1]}; "
                         "use blockwise or tensorwise on Hopper")


def plain_settings(tp: int = 1, pp: int = 1, *, params_dtype: str = "fp32",
                   transformer_impl: str = "local", cuda: bool = False) -> ResolvedSettings:
    """Settings with every scale feature off (no SP, plain optimizer, no recompute): what an actor
    built without a config runs with."""
    if params_dtype not in ("fp32", "bf16"):
        raise ValueError(f"params_dtype={params_dtype!r} is not supported (fp32 or bf16)")
    return ResolvedSettings(
        device="cuda" if cuda else "cpu", params_dtype=params_dtype,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=1,
        sequence_parallel=False, use_distributed_optimizer=False, overlap_grad_reduce=False,
        overlap_param_gather=False, recompute_granularity="none", recompute_method="uniform",
        recompute_num_layers=1, transformer_impl=transformer_impl, fp8_emulated=False)
