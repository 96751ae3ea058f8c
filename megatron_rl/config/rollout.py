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
