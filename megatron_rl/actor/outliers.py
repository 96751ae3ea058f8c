"""Planted activation outliers: an exact reparameterization that gives a few channels LLM-like magnitudes.

Real LLMs carry a few hidden channels whose activations are 20-100x the median (LLM.int8(),
Dettmers et al. 2022; "Massive Activations in Large Language Models", Sun et al. 2024); under a
per-tensor FP8 scale they set the amax and squeeze every other channel into the format's low range.
A tiny random model has none. This plants them by running SmoothQuant's migration (Xiao et al. 2022)
backwards: for each layer's pre-attention and pre-MLP RMSNorm and chosen channels c,

    gamma[c] *= s        (the norm's output channel c grows s times)
    W[:, c]  /= s        (the following linear: fused QKV, or the MLP's fused gate/up fc1)

so W @ (gamma * x_hat) is unchanged in exact arithmetic and only a quantizer sees the outliers.
A power-of-two s is exact in every float format; any other s rounds gamma and W once (about 2^-9
relative in BF16). The QKV and fc1 weights are column-parallel ([out / TP, hidden]: every TP rank
holds all input columns) and the norm weights are replicated, so each rank applies the same update
to its own shard and TP needs no communication; PP stages each plant their own layers.
"""

from __future__ import annotations

import re

import torch

# Pre-norm -> the linear that reads its output (local-spec canonical names, models/name_map.py).
_NORM_RE = re.compile(r"^(decoder\.layers\.\d+\.)(input_layernorm|pre_mlp_layernorm)\.weight$")
_READER = {"input_layernorm": "self_attention.linear_qkv.weight", "pre_mlp_layernorm": "mlp.linear_fc1.weight"}


def choose_outlier_channels(hidden_size: int, num_channels: int, seed: int) -> list[int]:
    """`num_channels` distinct hidden channels, the same on every rank for a given seed (sorted)."""
    if not 0 <= num_channels <= hidden_size:
        raise ValueError(f"config key 'model.outlier_channels': {num_channels} must be in [0, hidden_size="
                         f"{hidden_size}]")
    perm = torch.randperm(hidden_size, generator=torch.Generator().manual_seed(seed))
    return sorted(perm[:num_channels].tolist())


@torch.no_grad()
def plant_outliers(params: dict[str, torch.nn.Parameter], channels: list[int], scale: float) -> list[str]:
    """Scale norm weights up and the following linears' input columns down, in place.

    Args:
        params: canonical name -> parameter (MegatronActor._params); the same `channels` in every layer,
            as massive activations sit in fixed dimensions across layers (Sun et al. 2024, Sec. 2).
        channels: hidden indices; scale: s >= 1.
    Returns the names of the norms that were planted (this rank's PP stage).
    """
    if scale < 1.0:
        raise ValueError(f"config key 'model.outlier_scale': must be >= 1, got {scale}")
    idx = torch.tensor(channels, dtype=torch.long)
    planted = []
    for name, gamma in params.items():
        match = _NORM_RE.match(name)
        if match is None or not channels:
            continue
        weight = params[match.group(1) + _READER[match.group(2)]]
        assert weight.shape[1] == gamma.shape[0], (name, tuple(weight.shape), tuple(gamma.shape))
        gamma[idx.to(gamma.device)] *= scale
        weight[:, idx.to(weight.device)] /= scale
        planted.append(name)
    return planted
