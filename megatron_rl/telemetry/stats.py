"""Statistics of a multi-seed study (docs/reproduction.md): Fisher's exact test of event counts and a
bootstrap interval of a difference of means. Plain Python: exact sums over small integer tables."""

from __future__ import annotations

import math
import random


def _hypergeom(a: int, row1: int, row2: int, col1: int) -> float:
    """P(top-left cell = a) of a 2x2 table with fixed margins (row sums row1, row2; column sum col1)."""
    return math.comb(row1, a) * math.comb(row2, col1 - a) / math.comb(row1 + row2, col1)


def fisher_exact(events_a: int, n_a: int, events_b: int, n_b: int) -> float:
    """Two-sided p of Fisher's exact test for events_a of n_a against events_b of n_b: the summed
    probability of every table with the same margins that is no more likely than the observed one
    (R's fisher.test and scipy's convention, with a relative tolerance of 1e-7 for ties)."""
    for name, events, n in (("a", events_a, n_a), ("b", events_b, n_b)):
        if n < 1 or not 0 <= events <= n:
            raise ValueError(f"fisher_exact: arm {name} has {events} events of {n} runs")
    col1 = events_a + events_b
    observed = _hypergeom(events_a, n_a, n_b, col1)
    low, high = max(0, col1 - n_b), min(n_a, col1)
    p = sum(q for a in range(low, high + 1) if (q := _hypergeom(a, n_a, n_b, col1)) <= observed * (1 + 1e-7))
    return min(1.0, p)


def bootstrap_diff_ci(a: list[float], b: list[float], resamples: int = 10_000, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the percentile interval of the difference of means, resampling
    each arm's values with replacement on its own (unpaired)."""
    if not a or not b:
        raise ValueError(f"bootstrap_diff_ci: an arm has no values (sizes {len(a)}, {len(b)})")
    rng = random.Random(seed)
    diffs = sorted(sum(rng.choices(a, k=len(a))) / len(a) - sum(rng.choices(b, k=len(b))) / len(b)
                   for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    low = diffs[int(math.floor(tail * (resamples - 1)))]
    high = diffs[int(math.ceil((1.0 - tail) * (resamples - 1)))]
    return sum(a) / len(a) - sum(b) / len(b), low, high
