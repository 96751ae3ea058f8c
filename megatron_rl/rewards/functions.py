"""Verifiable reward functions (exact match, per-position match, final answer, math-verify) and their registry.

A reward function maps (response: str, answer: str, **extra) -> float, or a dict with "score",
numeric components and an optional "pred" (runner.normalize). It may raise or hang: the
RewardRunner (runner.py) turns either into reward 0.0 and counts it, so functions stay simple.
A user function is named by import path (user.py) wherever a built-in name is accepted.
"""

from __future__ import annotations

import re
from typing import Callable

from megatron_rl.rewards.dapo import dapo_accuracy, dapo_reward, extracted_or_none
from megatron_rl.rewards.user import check_signature, is_import_path, load_user_fn

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    """1.0 if the response equals the answer after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def position_match(response: str, answer: str) -> float:
    """Partial credit: fraction of character positions that agree, over the longer length.

    "12345" vs "12305" -> 0.8; a response one character too long loses 1/len; "" vs "" -> 1.0.
    Surrounding whitespace is stripped first, as in exact_match.
    """
    response, answer = response.strip(), answer.strip()
    longest = max(len(response), len(answer))
    if longest == 0:
        return 1.0
    return sum(r == a for r, a in zip(response, answer)) / longest


_INTEGER_RE = re.compile(r"-?\d{1,30}")


def _final_integer(text: str) -> int | None:
    """The integer after the last ':' (the whole text without one), or None if it is not one."""
    tail = text.rsplit(":", 1)[-1].strip()
    return int(tail) if _INTEGER_RE.fullmatch(tail) else None


def final_answer(response: str, answer: str) -> float:
    """1.0 if the integer after the response's last ':' equals the one after the answer's, else 0.0.

    The worked steps before it are not judged ("7+5=13,13+9=21:21" scores 1.0). Anything that is
    not a plain integer there ("", "21x", "2 1", a missing ':' with text before it) scores 0.0.
    """
    gold = _final_integer(answer)
    if gold is None:
        raise ValueError(f"the gold answer {answer!r} has no integer final answer")
    return 1.0 if _final_integer(response) == gold else 0.0


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equivalent to the gold answer.

    The gold answer is parsed as LaTeX: a bare gold such as "x^2+1" or "\\frac{1}{2}" is wrapped
    in $...$ first, because math-verify only extracts anchored LaTeX from it otherwise. The
    response may give its answer in \\boxed{}, $...$ or plain text ("The answer is 72.").
    math-verify bounds its own parsing with SIGALRM, which works only in a process's main thread;
    the RewardRunner's worker calls functions there.
    """
    from math_verify import parse, verify  # lazy: sympy and antlr take ~0.5 s to import

    if "$" not in answer and "\\boxed" not in answer:
        answer = f"${answer}$"
    gold = parse(answer)
    if not gold:
        raise ValueError(f"math-verify could not parse the gold answer {answer!r}")
    return 1.0 if verify(gold, parse(response)) else 0.0


REWARD_FNS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "position_match": position_match,
    "final_answer": final_answer,
    "math_verify": math_verify_reward,
    "dapo": dapo_reward,
    "dapo_accuracy": dapo_accuracy,
}


def _stripped(response: str) -> str | None:
    return response.strip() or None


def _final_integer_text(response: str) -> str | None:
    value = _final_integer(response)
    return None if value is None else str(value)


def _math_answer(response: str) -> str | None:
    """math-verify's canonical form of the response's final answer (its string rendering, so that
    "0.5" and "\\frac{1}{2}" vote together), or None when it finds none."""
    from math_verify import parse

    parsed = parse(response)
    return str(parsed[0]) if parsed else None


# What each built-in reward compares with the gold answer, for majority voting (maj@k): equal
# extracted strings are the same answer. A user reward gives it as the `pred` of a dict result.
ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "exact_match": _stripped,
    "position_match": _stripped,
    "final_answer": _final_integer_text,
    "math_verify": _math_answer,
    "dapo": extracted_or_none,
    "dapo_accuracy": extracted_or_none,
}


def get_answer_extractor(name: str) -> Callable[[str], str | None] | None:
    """The answer extractor of the built-in reward `name` (response -> answer string or None), or
    None when the reward has none (a user function: its dict results may carry `pred`)."""
    return ANSWER_EXTRACTORS.get(name)


def get_reward_fn(name: str, batched: bool = False) -> Callable:
    """A built-in (or registered) reward by name, or a user function by import path
    ("pkg.module:fn", "path/to/file.py:fn"), signature-checked; ValueError lists the registered names."""
    if is_import_path(name):
        fn = load_user_fn(name)
        check_signature(fn, name, batched)
        return fn
    if batched:
        raise ValueError(f"reward {name!r}: built-in rewards are per-sample; batched needs an import path")
    if name not in REWARD_FNS:
        raise ValueError(f"unknown reward function {name!r}; registered: {sorted(REWARD_FNS)}")
    return REWARD_FNS[name]


def register_reward_fn(name: str, fn: RewardFn) -> None:
    """Register a user reward function under `name` (e.g. from an examples/ task module)."""
    if name in REWARD_FNS and REWARD_FNS[name] is not fn:
        raise ValueError(f"reward function {name!r} is already registered")
    REWARD_FNS[name] = fn
