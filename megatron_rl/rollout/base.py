"""The rollout engine protocol (design.md section 5): sampling params, samples, and the engine ABC."""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch


@dataclass(frozen=True)
class SamplingParams:
    """One generate() call's sampling settings (names follow SGLang's sampling_params).

    temperature: 0 means greedy (argmax; log-probs then of the T=1 distribution, as SGLang).
    top_p: nucleus mass in (0, 1]; 1 disables it.
    max_new_tokens: response length cap; a sample that reaches it ends with finish_reason "length".
    stop_token_ids: a sampled token in this set ends the sample (it is kept in response_ids).
    ignore_eos: False adds the model config's eos_token_id to the stop set, as SGLang does.
    n: samples per prompt.
    seed: None continues the engine's own generator; an int makes the call reproducible alone.
    repetition_penalty: > 0; 1 disables it. A token the sample has generated already has its logit
        divided by it (multiplied when negative) before the temperature, as SGLang's
        BatchedRepetitionPenalizer (srt/sampling/penaltylib/repetition_penalty.py): prompt tokens are
        not penalised, and the returned log-probs are those of the penalised distribution.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] | list[str] = field(default_factory=tuple)
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")


def trim_at_stop(text: str, stop: tuple[str, ...] | list[str]) -> str:
    """`text` cut before the first stop string it contains (SGLang's detokenizer_manager.py
    trim_matched_stop, no_stop_trim=False); unchanged when it contains none."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


@dataclass
class Sample:
    """One response. rollout_logprobs[i] is the engine's log-prob of response_ids[i] (float32 math)."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: Literal["stop", "length"]


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 over f"{dtype}|{shape}|" and the raw bytes of `t` as held (FP8 bytes for FP8).

    The weight-sync check mode hashes what it sends with the same recipe; the two must agree.
    """
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    # reshape(-1) first: a 0-d tensor (a tensorwise weight_scale) cannot be viewed as bytes.
    # clone(): numpy() marks the storage it views non-resizable for good, and the colocated
    # offload frees parameter storages by resizing them (actor/offload.py).
    h.update(t.reshape(-1).view(torch.uint8).clone().numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class RolloutEngine(abc.ABC):
    """What the RL loop needs from an inference engine (embedded torch, SGLang servers).

    Weight update protocol (SGLang's pause / update / flush / continue, per version)::

        engine.pause()                                  # no generate() until resume()
        for bucket in buckets:                          # HF names; FP8 as weight + weight_scale_inv
            engine.update_weights(bucket, version)      # any number of buckets, one version
        engine.finish_update(version)                   # complete: adopt version, flush caches
        engine.resume()
        engine.checksum(names)                          # optional: digests of what is held

    Colocated runs call release_memory(("weights", "kv_cache", "cuda_graph")) before training, then
    resume_memory(("weights",)), the weight update, and resume_memory(("kv_cache", "cuda_graph"))
    (megatron_rl/loop/colocated.py owns the order); released weights are discarded (as SGLang's
    release_memory_occupation), so a full update must follow. tags=None means every region.
    """

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """n samples per prompt, contiguous by prompt: [p0 s0, p0 s1, ..., p1 s0, ...]."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load one bucket of HF-named tensors of weight version `version`."""

    @abc.abstractmethod
    def finish_update(self, version: int) -> None:
        """Mark `version` complete (every bucket sent); flush caches; weight_version becomes it."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights generate() uses (0 = as loaded)."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop serving generate() (in-flight calls finish first)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Serve generate() again."""

    @abc.abstractmethod
    def release_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """Free the "weights", "kv_cache" and/or "cuda_graph" regions; released weights are lost
        until the next full update."""

    @abc.abstractmethod
    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        """Re-allocate regions released by release_memory() (the tags named; None: every region)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Free everything; the engine is unusable afterwards."""

    @abc.abstractmethod
    def checksum(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """{HF name: tensor_digest} of the tensors held (all when names is None)."""
