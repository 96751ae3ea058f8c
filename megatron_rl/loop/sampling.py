"""How the loop samples and scores: the one path that training rollouts and evaluation share.

Sampling settings come from the `rollout` section, with per-call overrides (an eval dataset's);
responses are decoded and cut at a stop string as the reward sees them; every response's reward
gets its prompt's answer, the row's other columns and the prompt itself (`prompt`: the text the
policy saw, chat template applied; slime's Sample.prompt).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.rollout.base import SamplingParams, trim_at_stop

# Fields of SamplingParams that the rollout section sets and an eval dataset may override.
SAMPLING_KNOBS = ("temperature", "top_p", "max_new_tokens", "top_k", "min_p", "stop", "stop_token_ids",
                  "repetition_penalty")


def sampling_params(rollout_cfg, eos_token_id: int, *, n: int, seed: int,
                    overrides: dict[str, Any] | None = None) -> SamplingParams:
    """The `rollout` section's sampling, with every `overrides` entry that is not None in its place.
    The tokenizer's eos always stops a sample, besides the stop_token_ids."""
    knobs = {k: getattr(rollout_cfg, k) for k in SAMPLING_KNOBS}
    knobs.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return SamplingParams(n=n, seed=seed, **{**knobs, "stop": tuple(knobs["stop"]),
                                             "stop_token_ids": [eos_token_id, *knobs["stop_token_ids"]]})


def response_texts(tokenizer, samples, stop) -> list[str]:
    """The decoded responses (special tokens dropped), each cut before its first stop string: the
    engines keep a stop string's tokens, the reward sees the text before it."""
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    return [trim_at_stop(t, stop) for t in texts] if stop else texts


def reward_extra(prompt) -> dict[str, Any]:
    """The keyword arguments a reward may take for one prompt (data.PromptItem): the row's other
    columns and `prompt`, the prompt text (it takes the place of a row column of that name)."""
    return {**prompt.extra, "prompt": prompt.prompt_text}


def score_texts(runner, prompts, texts: list[str], n: int) -> tuple[list[float], dict[str, Any]]:
    """RewardRunner.score of `texts` (n per prompt, contiguous), each with its prompt's answer and
    reward_extra."""
    answers = [prompts[i // n].answer for i in range(len(texts))]
    extras = [reward_extra(prompts[i // n]) for i in range(len(texts))]
    return runner.score(texts, answers, extras=extras)
