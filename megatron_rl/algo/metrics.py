"""Additive loss metrics: (numerator, denominator) pairs reduced across micro-batches and DP ranks."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

Reducer = Callable[[torch.Tensor], torch.Tensor]
Metrics = dict[str, torch.Tensor]

# Convention: every metric value is a float64 tensor [2] = (numerator_sum, denominator_sum), detached.
# Sums add across micro-batches and ranks; the ratio is taken once, at the end. A mean of per-rank
# means would weight a rank holding 10 tokens like one holding 10k.
#
# Derived metrics: a pair "X/mean" + "X/mean_sq" yields "X/std" (population std from E[x^2] - E[x]^2,
# in float64); "is_weight/mean" + "is_weight/mean_sq" also yield "ess" = E[w]^2 / E[w^2] in (0, 1].


def identity_reduce(t: torch.Tensor) -> torch.Tensor:
    """The single-process reducer: returns its argument unchanged."""
    return t


def metric(numerator: torch.Tensor | float, denominator: torch.Tensor | float) -> torch.Tensor:
    """Pack one additive metric as a detached float64 tensor [2] = (numerator, denominator)."""
    num = torch.as_tensor(numerator).detach().to(torch.float64).reshape(())
    den = torch.as_tensor(denominator).detach().to(torch.float64).reshape(())
    return torch.stack([num, den])


def masked_metric(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the boolean `where` (same shape) as an additive (sum, count) metric."""
    values = torch.where(where, values.detach().to(torch.float64), 0.0)
    return metric(values.sum(), where.sum())


def mean_and_square(prefix: str, values: torch.Tensor, where: torch.Tensor) -> Metrics:
    """`prefix/mean` and `prefix/mean_sq` of `values` over `where`; reduce_metrics derives `prefix/std`."""
    return {
        f"{prefix}/mean": masked_metric(values, where),
        f"{prefix}/mean_sq": masked_metric(values.detach().double().square(), where),
    }


def sum_metrics(metric_dicts: Iterable[Metrics]) -> Metrics:
    """Element-wise sum of metric dicts; a key missing from one dict contributes (0, 0)."""
    out: Metrics = {}
    for d in metric_dicts:
        for key, value in d.items():
            assert value.shape == (2,), f"metric {key} must be a [2] tensor, got {tuple(value.shape)}"
            out[key] = out[key] + value.double() if key in out else value.double().clone()
    return out


def reduce_metrics(metric_dicts: Iterable[Metrics], reduce: Reducer | None = None) -> dict[str, float]:
    """Sum metric dicts over micro-batches, all-reduce once, divide, add derived std / ess entries.

    Args:
        metric_dicts: dicts of float64 [2] tensors (numerator, denominator), e.g. one per micro-batch.
        reduce: sums a float tensor across ranks in place and returns it (all_reduce bound to the DP
            group). Called exactly once. Every rank must pass the same key set, which holds when all
            ranks call the losses with the same options: keys are sorted to fix the payload layout.

    Returns:
        {name: numerator / denominator}; NaN where the global denominator is 0 (e.g. no A<0 tokens).
    """
    summed = sum_metrics(metric_dicts)
    keys = sorted(summed)
    if not keys:
        return {}
    payload = torch.stack([summed[k] for k in keys])
    payload = (reduce or identity_reduce)(payload)
    out = {k: _safe_div(float(num), float(den)) for k, (num, den) in zip(keys, payload.tolist())}
    return _add_derived(out)


def _safe_div(num: float, den: float) -> float:
    return num / den if den != 0.0 else math.nan


def _add_derived(out: dict[str, float]) -> dict[str, float]:
    for key in [k for k in out if k.endswith("/mean_sq")]:
        base = key[: -len("/mean_sq")]
        mean = out.get(f"{base}/mean", math.nan)
        # Clamp the cancellation residue of E[x^2] - E[x]^2 at 0 before the sqrt.
        variance = out[key] - mean * mean
        out[f"{base}/std"] = math.nan if math.isnan(variance) else math.sqrt(max(variance, 0.0))
    if "is_weight/mean" in out and "is_weight/mean_sq" in out:
        w_mean, w_sq = out["is_weight/mean"], out["is_weight/mean_sq"]
        # <= 1 by Cauchy-Schwarz; min() drops the last-bit round-off above it.
        out["ess"] = min(w_mean * w_mean / w_sq, 1.0) if w_sq > 0 else math.nan
    return out
