"""The `rollout` section: engine, sampling knobs, the SGLang servers (rollout.sglang)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_rl.config.precision import FP4_ROLLOUT_QUANTS
from megatron_rl.rollout.sglang_config import SGLangConfig, validate_sglang

if TYPE_CHECKING:
    from megatron_rl.config.run import RunConfig


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
    repetition_penalty: float = 1.0
    """In (0, 2]; 1 = off. A token the sample already generated has its logit divided by it (multiplied
    when negative) before the temperature; prompt tokens are not penalised. SGLang's
    repetition_penalty, implemented alike by the torch engine. The rollout log-probs are those of
    the penalised distribution: the trainer's are not, so the mismatch metrics include the penalty."""
    seed: int | None = None
    """Base seed of rollout sampling (per step and rank seeds derive from it); null = train.seed.
    SGLang applies per-request seeds only with rollout.sglang.deterministic_inference."""
    kv_cache_dtype: str = "auto"
    """auto | fp8_e4m3. rollout.engine=torch: fp8_e4m3 emulates SGLang's FP8 KV cache (K / V stored
    as E4M3 at per-layer scales that come with every sync, rollout.sglang.kv_scales: calibrated or
    unit), so its effect on the mismatch metrics shows on CPU. auto: the model's dtype. SGLang's own
    cache is rollout.sglang.kv_cache_dtype."""


CHOICES = {"engine": ("torch", "sglang"), "kv_cache_dtype": ("auto", "fp8_e4m3")}
POSITIVE = ("n_samples_per_prompt", "max_new_tokens", "temperature")


def check_top_p(r: RolloutConfig) -> None:
    if not 0.0 < r.top_p <= 1.0:
        raise ValueError(f"config key 'rollout.top_p': must be in (0, 1], got {r.top_p}")


def check_group_size(r: RolloutConfig) -> None:
    if r.n_samples_per_prompt < 2:
        raise ValueError("config key 'rollout.n_samples_per_prompt': group advantages need >= 2 "
                         f"samples per prompt, got {r.n_samples_per_prompt}")


def check_sglang(cfg: RunConfig) -> None:
    """The SGLang servers' own settings and what they can serve of precision.rollout_quant."""
    if cfg.rollout.engine != "sglang":
        return
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


def check_sampling(cfg: RunConfig) -> None:
    r = cfg.rollout
    check_sampling_knobs(r, "rollout")
    if r.engine == "sglang" and r.min_p > 0 and r.sglang.deterministic_inference:
        # srt/layers/sampler.py asserts sampling_seed is None on the min-p path.
        raise ValueError("config key 'rollout.min_p': SGLang's seeded (deterministic) sampler does not "
                         "support min_p; set rollout.min_p=0 or rollout.sglang.deterministic_inference=false")


def check_sampling_knobs(section, key: str) -> None:
    """top_k, min_p, stop, stop_token_ids and repetition_penalty of `section` (the rollout section or
    an eval dataset, where None means: the rollout's)."""
    top_k, min_p, rep = section.top_k, section.min_p, section.repetition_penalty
    if top_k is not None and not (top_k == -1 or top_k >= 1):
        raise ValueError(f"config key '{key}.top_k': must be -1 (off) or >= 1, got {top_k}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"config key '{key}.min_p': must be in [0, 1], got {min_p}")
    if any(not s for s in section.stop or ()):
        raise ValueError(f"config key '{key}.stop': empty stop string in {section.stop}")
    if any(t < 0 for t in section.stop_token_ids or ()):
        raise ValueError(f"config key '{key}.stop_token_ids': negative id in {section.stop_token_ids}")
    if rep is not None and not 0.0 < rep <= 2.0:  # SGLang's range (srt/sampling/sampling_params.py)
        raise ValueError(f"config key '{key}.repetition_penalty': must be in (0, 2] (1 = off), got {rep}")
