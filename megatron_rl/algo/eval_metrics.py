"""Evaluation estimators over k samples per problem: avg@k, pass@k (Chen et al. 2021), maj@k.

Each estimator scores one problem from its n sampled responses (rewards in [0, 1], the extracted
answers); a dataset's number is the mean over problems. Everything is plain Python floats: the
loop sums per-problem scores and counts over data-parallel ranks (sums, never means of means).

    avg@k   mean reward of the n samples: the unbiased estimate of the expected mean over k
            samples (it does not depend on k <= n; verl's mean@N, the paper's Avg@32).
    pass@k  1 - C(n - c, k) / C(n, k), c = samples with reward >= PASS_THRESHOLD: the unbiased
            probability that at least one of k samples drawn without replacement passes.
    maj@k   the reward of the most frequent extracted answer among the first k samples. Ties:
            the mean reward of the tied answers (the expected score of a uniformly random tie
            break, so no answer order decides); samples with no extracted answer do not vote;
            no vote at all scores 0.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

METRIC_KINDS = ("avg", "pass", "maj")
PASS_THRESHOLD = 1.0 - 1e-6  # a sample "passes" when its reward is (numerically) full credit
_METRIC_RE = re.compile(r"(avg|pass|maj)@([0-9]+)")


def parse_metric(name: str) -> tuple[str, int]:
    """"pass@4" -> ("pass", 4); ValueError for anything else (kinds: avg, pass, maj; k >= 1)."""
    match = _METRIC_RE.fullmatch(name)
    if match is None or int(match.group(2)) < 1:
        raise ValueError(f"unknown metric {name!r}: expected avg@k, pass@k or maj@k with k >= 1")
    return match.group(1), int(match.group(2))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 - C(n-c, k) / C(n, k), k <= n.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) (Chen et al. 2021, Codex paper, Fig. 3): no
    binomial of large n is ever formed, so it is exact to float rounding for any n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def avg_at_k(rewards: Sequence[float]) -> float:
    """Mean reward of one problem's samples."""
    if not rewards:
        raise ValueError("avg@k of a problem without samples")
    return sum(rewards) / len(rewards)


def maj_at_k(answers: Sequence[str | None], rewards: Sequence[float], k: int) -> float:
    """Majority-vote score of one problem over its first k samples (tie rule: module docstring).

    answers[i]: the answer extracted from sample i (None: none could be extracted); rewards[i]:
    that sample's reward. An answer's reward is the mean over the samples that gave it.
    """
    if len(answers) != len(rewards) or not 1 <= k <= len(answers):
        raise ValueError(f"maj@k needs k <= n answers and one reward each, got k={k}, "
                         f"{len(answers)} answers, {len(rewards)} rewards")
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, count in votes.items() if count == top]
    return sum(_answer_reward(a, answers[:k], rewards[:k]) for a in tied) / len(tied)


def _answer_reward(answer: str, answers: Sequence[str | None], rewards: Sequence[float]) -> float:
    scores = [r for a, r in zip(answers, rewards) if a == answer]
    return sum(scores) / len(scores)


def problem_scores(metrics: Sequence[str], rewards: Sequence[float],
                   answers: Sequence[str | None] | None) -> dict[str, float]:
    """{metric: score} of one problem for names like "avg@4" (k <= len(rewards)).

    maj@k needs `answers`; without an extractor (None) it is left out."""
    out = {}
    for name in metrics:
        kind, k = parse_metric(name)
        if k > len(rewards):
            raise ValueError(f"metric {name!r}: k={k} exceeds the {len(rewards)} samples per problem")
        if kind == "avg":
            out[name] = avg_at_k(rewards)
        elif kind == "pass":
            out[name] = pass_at_k(len(rewards), sum(r >= PASS_THRESHOLD for r in rewards), k)
        elif answers is not None:
            out[name] = maj_at_k(answers, rewards, k)
    return out
