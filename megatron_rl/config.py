"""Typed, nested run configuration: YAML files plus `section.key=value` overrides, validated at start."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.actor.settings import validate_parallel
from megatron_rl.algo.calibrated_clip import controller_from_config
from megatron_rl.rollout.sglang_config import SGLangConfig, validate_sglang

TRAIN_RECIPES = ("bf16", "delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4", "mxfp4")
ROLLOUT_QUANTS = ("bf16", "fp8_blockwise", "fp8_tensorwise", "nvfp4", "mxfp4")
FP4_ROLLOUT_QUANTS = ("nvfp4", "mxfp4")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class ModelConfig:
    hf_dir: str = ""
    """HF checkpoint folder (config.json + safetensors). Empty: build the tiny built-in model below."""
    megatron_ckpt: str = ""
    """Optional torch_dist folder (tools/convert_hf_to_megatron.py) to take the weights from instead
    of hf_dir's safetensors; hf_dir still gives the config and tokenizer. The optimizer starts fresh."""
    tiny_arch: str = "qwen2"
    """Architecture of the tiny built-in model (llama | qwen2 | qwen3), used when hf_dir is empty."""
    tiny_hidden_size: int = 128
    tiny_num_layers: int = 2
    tiny_num_heads: int = 4
    tiny_num_kv_heads: int = 2
    tiny_ffn_hidden_size: int = 256
    outlier_channels: int = 0
    """Stress lever: plant LLM-like activation outliers in this many hidden channels of every
    pre-attention / pre-MLP norm output, by an exact reparameterization applied once before the
    first weight sync of a fresh run (actor/outliers.py, docs/fp8.md). 0 = off."""
    outlier_scale: float = 32.0
    """Factor s >= 1 of the planted channels. 32: LLM.int8()-sized (20-100x the median): FP4 errors
    grow ~2.7x, E4M3's exponent absorbs it; FP8 errors grow from about 2^15 (massive activations).
    A power of two is exact."""


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


@dataclass
class PrecisionConfig:
    """The precision contract (design.md section 3): read by the trainer, weight sync and engine."""

    params_dtype: str = "auto"
    """auto | bf16 | fp32. Parameter dtype of the trainer. bf16 = Megatron's Float16Module with a
    mixed-precision optimizer (FP32 main parameters and FP32 gradient accumulation), as Megatron-LM
    runs under --bf16. auto: bf16 on GPUs; on CPU what the CPU compatibility layer chooses."""
    train_recipe: str = "bf16"
    """bf16 | delayed | tensorwise | rowwise | blockwise | mxfp8 | nvfp4 | mxfp4. On CPU the FP8 and
    FP4 recipes are emulated. nvfp4 (TE NVFP4BlockScaling) needs Blackwell on GPU; mxfp4 has no TE
    recipe and runs on CPU only (docs/fp8.md, FP4)."""
    fp8_format: str = "hybrid"
    """hybrid (E4M3 forward, E5M2 backward) | e4m3. Ignored by nvfp4 / mxfp4 (every operand E2M1)."""
    amax_history_len: int = 1024
    """Delayed scaling only: length of the amax history (TE DelayedScaling default)."""
    rollout_quant: str = "bf16"
    """bf16 | fp8_blockwise (W8A8: weights 128x128, activations 1x128 dynamic) | fp8_tensorwise |
    nvfp4 | mxfp4 (W4A4 emulation, rollout.engine=torch only: weights quantized once per sync,
    activations dynamically; docs/fp8.md, Rollout W4A4)."""
    weight_block_size: list[int] = field(default_factory=lambda: [128, 128])
    scale_format: str = "fp32"
    """fp32 | ue8m0 (power-of-two scales, as DeepGEMM and Blackwell want)."""
    high_precision: list[str] = field(
        default_factory=lambda: ["embed_tokens", "lm_head", "norm"])
    """HF-name substrings of tensors that stay high precision everywhere."""


@dataclass
class AlgoConfig:
    """Advantage estimator and policy loss; knob names follow slime/miles."""

    advantage_estimator: str = "grpo"
    """grpo (group-normalised) | dr_grpo (no std) | rloo (leave-one-out baseline)."""
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    """DAPO clip-higher uses 0.28."""
    eps_clip_c: float | None = None
    """Dual-clip constant (> 1) for negative advantages; None disables it."""
    loss_agg_mode: str = "token-mean"
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all agree (no advantage signal)."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: linear penalty within the last N tokens before max_new_tokens; 0 = off."""
    overlong_penalty_factor: float = 1.0
    use_tis: bool = True
    tis_mode: str = "truncate"
    """truncate (TIS) | icepop (MIS: mask tokens whose rollout ratio leaves [icepop_low, icepop_high])."""
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as old log-probs instead of a trainer recompute."""
    kl_loss_type: str = "k3"
    kl_loss_coef: float = 0.0
    entropy_coef: float = 0.0


@dataclass
class CalibConfig:
    """Calibrated Clipping (paper.md 1.4)."""

    enabled: bool = False
    period: int = 20
    """K: recalibrate (two BF16 shadow forwards) every K steps."""
    smoothing: float = 0.5
    """EMA weight of a new L (1.0 = take it as is); H is then solved at the smoothed L so the
    applied pair still balances. Default from the ablation in docs/algo.md."""
    mode: str = "two_sided"
    """two_sided (L by quantile matching, H rebalanced) | lower_only (the one-sided ablation)."""
    num_bins: int = 2048
    """Histogram resolution over log r (the all-reduce payload does not grow with tokens)."""
    diagnose: bool = False
    """Run the BF16 shadow every `period` steps for telemetry (false-clip rate, log-ratio std)
    even when calibration is off: how the vanilla-FP8 failure is measured."""
    init_low: float | None = None
    """L before the first calibration; None = 1 - algo.eps_clip (the paper's ablation used 0.6)."""
    init_high: float | None = None
    """H before the first calibration and while H can't be solved; None = 1 + algo.eps_clip_high
    (the paper's default 1.8)."""
    low_min: float = 0.5
    """L is held in [low_min, 1]."""
    high_max: float = 2.0
    """H is held in [1, high_max]."""
    alpha_tolerance: float = 0.002
    """Match slack as a fraction of a side's (loss-weighted) tokens: any bound whose clip mass is
    within it of the BF16 target is exact, and the one closest to the BF16 bound is taken."""
    alpha_tolerance_tokens: float = 1.0
    """The same slack in tokens (the larger of the two applies): a few tokens can't move a bound."""
    balance: str = "abs_adv"
    """How a side's update mass is measured for H: count | abs_adv | abs_adv_ratio (docs/algo.md)."""
    log_ratio_range: float = 2.0
    """The histogram spans log r in [-R, R]; ratios beyond are clamped into the end bins, and a
    bound landing in such a bin is not trusted (the previous one is kept)."""
    dump_dir: str = ""
    """If set, every reduced calibration histogram is saved there (offline ablations)."""


@dataclass
class RolloutConfig:
    engine: str = "torch"
    """torch (embedded, in-process) | sglang (GPU servers)."""
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang servers, router and weight transport (rollout.engine=sglang; GPU only)."""
    kv_cache_dtype: str = "auto"
    """auto | fp8_e4m3. rollout.engine=torch: fp8_e4m3 emulates SGLang's FP8 KV cache (K / V stored
    as E4M3 at per-layer scales that come with every sync, rollout.sglang.kv_scales: calibrated or
    unit), so its effect on the mismatch metrics shows on CPU. auto: the model's dtype. SGLang's own
    cache is rollout.sglang.kv_cache_dtype."""


@dataclass
class SyncConfig:
    bucket_size_mb: float = 512.0
    check: bool = False
    """Compare checksums of what the engine holds with what was sent, after every sync."""


@dataclass
class DataConfig:
    task: str = "sort"
    """Built-in task for the tiny demo; ignored when `path` is set."""
    path: str = ""
    """Prompt dataset (.jsonl or .parquet)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_len: int = 64
    num_examples: int = 4096
    """Built-in tasks: how many prompts to generate."""
    prompts_per_step: int = 16


@dataclass
class RewardConfig:
    name: str = ""
    """Reward function by name; empty = the built-in task's own reward."""
    timeout_s: float = 10.0


@dataclass
class TrainConfig:
    num_steps: int = 40
    num_mini_batches: int = 2
    """Optimizer steps per RL step (PPO mini-batches)."""
    ppo_epochs: int = 1
    micro_batch_size: int = 16
    lr: float = 1e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 1234
    sft_steps: int = 0
    """Supervised warm start (built-in tasks) before RL."""
    sft_lr: float = 1e-3
    sft_batch_size: int = 32
    logprob_chunk_size: int = 2048
    """Tokens per chunk of the log-prob / entropy computation (response tokens only, recomputed in
    backward): extra memory O(chunk x vocab / TP) instead of O(sequence x vocab / TP). 0 = the whole
    micro-batch at once, every position (the reference path)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of a packed micro-batch: sequences are packed (positions and attention restart
    per sequence) into micro-batches of at most this many tokens plus the FP8 padding. 0 = padded
    rows, micro_batch_size per micro-batch. Must hold the longest sequence (prompt + response)."""
    allow_oversized: bool = False
    """Start on GPUs even when the memory plan (`megatron-rl plan`, docs/plan.md) says the config
    does not fit. Off: training refuses such a config at start, printing the plan."""
    colocated_protocol: bool = True
    """Colocated engines (the embedded one always): release the engine's memory while training and
    offload the trainer's parameters, gradients and optimizer state to host memory while the engine
    works, in the order of megatron_rl/loop/colocated.py. On CPU it frees nothing that matters but runs
    the same order, so the CPU loop exercises it; false keeps both resident."""


@dataclass
class LogConfig:
    dir: str = "runs/default"
    tensorboard: bool = True
    progress: bool = True
    plot: bool = True


@dataclass
class HealthConfig:
    """The entropy-surge detector (megatron_rl/telemetry/health.py, docs/health.md)."""

    entropy_rise: float = 0.5
    """Rise threshold: a step rises when entropy / running minimum - 1 >= this (0.5 = 50% above
    the lowest entropy so far; paper.md's failure multiplies the entropy several times over)."""
    patience: int = 10
    """Consecutive rising steps (steps without an entropy neither count nor break the streak) that
    make a surge; also the consecutive steps of garbled_rate that make a garbled surge."""
    warmup_steps: int = 0
    """Steps 0..warmup_steps-1 are ignored for the minimum and never rise. 0: no step is exempt,
    so a surge from the start is seen; set it when the first RL steps after SFT are unrepresentative."""
    garbled_rate: float = 0.5
    """Garbled surge threshold: fraction of a step's responses that fail the task's format check."""


@dataclass
class CheckpointConfig:
    save_every: int = 0
    """Steps between checkpoints (0 = only at the end when `save_final`)."""
    save_final: bool = True
    resume: bool = False
    async_save: bool = False
    """Write the model/optimizer checkpoint in a background process (Megatron's async save); it
    is published (renamed, `latest` moved) once written everywhere, always before the next save
    and the end of the run."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    calib: CalibConfig = field(default_factory=CalibConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_CHOICES = {
    "precision.train_recipe": TRAIN_RECIPES,
    "rollout.kv_cache_dtype": ("auto", "fp8_e4m3"),
    "precision.fp8_format": ("hybrid", "e4m3"),
    "precision.params_dtype": ("auto", "bf16", "fp32"),
    "parallel.recompute_granularity": ("none", "selective", "full"),
    "parallel.recompute_method": ("uniform", "block"),
    "parallel.transformer_impl": ("auto", "transformer_engine", "local"),
    "precision.rollout_quant": ROLLOUT_QUANTS,
    "precision.scale_format": ("fp32", "ue8m0"),
    "algo.advantage_estimator": ("grpo", "dr_grpo", "rloo"),
    "algo.loss_agg_mode": LOSS_AGG_MODES,
    "algo.tis_mode": ("truncate", "icepop"),
    "algo.kl_loss_type": ("k1", "k2", "k3"),
    "calib.mode": ("two_sided", "lower_only"),
    "calib.balance": ("count", "abs_adv", "abs_adv_ratio"),
    "rollout.engine": ("torch", "sglang"),
    "model.tiny_arch": ("llama", "qwen2", "qwen3"),
}

_POSITIVE = (
    "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
    "parallel.context_parallel_size", "parallel.recompute_num_layers",
    "calib.period", "calib.num_bins", "rollout.n_samples_per_prompt", "rollout.max_new_tokens",
    "data.prompts_per_step", "data.max_prompt_len", "train.num_mini_batches", "train.ppo_epochs",
    "train.micro_batch_size", "rollout.temperature", "sync.bucket_size_mb", "reward.timeout_s",
    "health.entropy_rise", "health.patience",
)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting ints to floats; ValueError names `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key '{key}': expected a list, got {value!r}")
        return [_coerce(v, args[0], key) for v in value]
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key '{key}': expected true/false, got {value!r}")
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    raise ValueError(f"config key '{key}': expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _apply(section: Any, updates: dict[str, Any], prefix: str) -> None:
    hints = typing.get_type_hints(type(section))
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in hints:
            known = ", ".join(sorted(hints))
            raise ValueError(f"unknown config key '{path}' (known in this section: {known})")
        current = getattr(section, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key '{path}' is a section; expected a mapping, got {value!r}")
            _apply(current, value, f"{path}.")
        else:
            setattr(section, key, _coerce(value, hints[key], path))


def _get(cfg: RunConfig, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig) -> RunConfig:
    """Check value ranges and cross-field rules; raise one ValueError naming the key."""
    for path, choices in _CHOICES.items():
        if _get(cfg, path) not in choices:
            raise ValueError(f"config key '{path}': {_get(cfg, path)!r} is not one of {list(choices)}")
    for path in _POSITIVE:
        if not _get(cfg, path) > 0:
            raise ValueError(f"config key '{path}': must be > 0, got {_get(cfg, path)!r}")
    if not 0.0 < cfg.algo.eps_clip < 1.0:
        raise ValueError(f"config key 'algo.eps_clip': must be in (0, 1), got {cfg.algo.eps_clip}")
    if cfg.algo.eps_clip_high <= 0.0:
        raise ValueError(f"config key 'algo.eps_clip_high': must be > 0, got {cfg.algo.eps_clip_high}")
    if cfg.algo.eps_clip_c is not None and cfg.algo.eps_clip_c <= 1.0:
        raise ValueError(f"config key 'algo.eps_clip_c': dual-clip needs c > 1, got {cfg.algo.eps_clip_c}")
    if not 0.0 < cfg.calib.smoothing <= 1.0:
        raise ValueError(f"config key 'calib.smoothing': must be in (0, 1], got {cfg.calib.smoothing}")
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ValueError(f"config key 'rollout.top_p': must be in (0, 1], got {cfg.rollout.top_p}")
    if len(cfg.precision.weight_block_size) != 2 or min(cfg.precision.weight_block_size) <= 0:
        raise ValueError("config key 'precision.weight_block_size': expected two positive ints, "
                         f"got {cfg.precision.weight_block_size}")
    if cfg.rollout.n_samples_per_prompt < 2:
        raise ValueError("config key 'rollout.n_samples_per_prompt': group advantages need >= 2 "
                         f"samples per prompt, got {cfg.rollout.n_samples_per_prompt}")
    if (cfg.calib.enabled or cfg.calib.diagnose) and cfg.precision.train_recipe == "bf16":
        raise ValueError("config key 'calib.enabled': calibrated clipping calibrates FP8 against the "
                         "BF16 shadow; it needs precision.train_recipe other than 'bf16'")
    _validate_token_budget(cfg)
    if cfg.health.warmup_steps < 0:
        raise ValueError(f"config key 'health.warmup_steps': must be >= 0, got {cfg.health.warmup_steps}")
    if not 0.0 < cfg.health.garbled_rate <= 1.0:
        raise ValueError(f"config key 'health.garbled_rate': must be in (0, 1], got {cfg.health.garbled_rate}")
    _validate_outliers(cfg.model)
    if cfg.rollout.engine == "sglang":
        validate_sglang(cfg.rollout.sglang)
        if cfg.precision.rollout_quant in FP4_ROLLOUT_QUANTS:
            raise ValueError(f"config key 'precision.rollout_quant': {cfg.precision.rollout_quant!r} (W4A4) "
                             "is emulated by the torch rollout engine only; SGLang rollouts take bf16, "
                             "fp8_blockwise or fp8_tensorwise (or set rollout.engine=torch)")
        if cfg.rollout.sglang.quantization == "fp8" and cfg.precision.rollout_quant == "fp8_blockwise":
            raise ValueError("config key 'rollout.sglang.quantization': 'fp8' quantizes a BF16 checkpoint online "
                             "per channel (weight_scale), so the blockwise updates of precision.rollout_quant="
                             "fp8_blockwise (weight_scale_inv) have nowhere to go; leave it empty and let the "
                             "servers load a block-FP8 checkpoint (rollout.sglang.model_path or the automatic one)")
    validate_parallel(cfg)
    _validate_calib(cfg)
    _validate_host_wait(cfg)
    return cfg


def _validate_token_budget(cfg: RunConfig) -> None:
    t = cfg.train
    if t.logprob_chunk_size < 0:
        raise ValueError(f"config key 'train.logprob_chunk_size': must be >= 0, got {t.logprob_chunk_size}")
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if t.max_tokens_per_micro_batch < 0 or 0 < t.max_tokens_per_micro_batch < longest:
        raise ValueError(f"config key 'train.max_tokens_per_micro_batch': {t.max_tokens_per_micro_batch} "
                         f"must be 0 (off) or hold the longest sequence, data.max_prompt_len + "
                         f"rollout.max_new_tokens = {longest}")


def _validate_outliers(m: ModelConfig) -> None:
    """Bounds known before the model is read; hf_dir's hidden size is checked when planting."""
    if m.outlier_channels < 0:
        raise ValueError(f"config key 'model.outlier_channels': must be >= 0, got {m.outlier_channels}")
    if not m.hf_dir and m.outlier_channels > m.tiny_hidden_size:
        raise ValueError(f"config key 'model.outlier_channels': {m.outlier_channels} exceeds the hidden size "
                         f"(model.tiny_hidden_size={m.tiny_hidden_size})")
    if not m.outlier_scale >= 1.0:
        raise ValueError(f"config key 'model.outlier_scale': must be >= 1, got {m.outlier_scale}")


def _validate_calib(cfg: RunConfig) -> None:
    """The controller's own checks, reported against the config key they come from."""
    try:
        controller_from_config(cfg.calib, cfg.algo)
    except ValueError as err:
        key = next((k for k in ("init_low", "init_high", "low_min", "high_max", "alpha_tolerance_tokens",
                                "alpha_tolerance", "log_ratio_range") if str(err).startswith(k)), "calib")
        raise ValueError(f"config key 'calib.{key}': {err}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """Parse `section.key=value` (value in YAML syntax) into (dotted key, value)."""
    if "=" not in text:
        raise ValueError(f"override '{text}': expected section.key=value")
    key, raw = text.split("=", 1)
    if "." not in key:
        raise ValueError(f"override '{text}': expected section.key=value")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def _nest(key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build a RunConfig from a YAML file (optional) and `section.key=value` overrides, validated."""
    cfg = RunConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file not found: {path}")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path}: expected a mapping at the top level")
        _apply(cfg, data, "")
    for text in overrides:
        key, value = parse_override(text)
        _apply(cfg, _nest(key, value), "")
    return validate(cfg)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def _validate_host_wait(cfg: RunConfig) -> None:
    t = cfg.parallel.host_wait_timeout_s
    sg = cfg.rollout.sglang
    if t < 0:
        raise ValueError(f"config key 'parallel.host_wait_timeout_s': must be >= 0 (0 = sized to the job), got {t}")
    if t and cfg.rollout.engine == "sglang" and t < sg.startup_timeout_s:
        raise ValueError(f"config key 'parallel.host_wait_timeout_s': {t} s is shorter than a server start "
                         f"(rollout.sglang.startup_timeout_s={sg.startup_timeout_s}): the other ranks would "
                         "give up while the owners' servers still start")
