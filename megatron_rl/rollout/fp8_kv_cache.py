"""The embedded engine's emulation of SGLang's FP8 KV cache: keys and values stored as E4M3 with a
per-layer scale (K / k_scale, V / v_scale), read back as E4M3 x scale by every attention that uses
the cache, as SGLang writes and reads its pool (mem_cache/memory_pool.py set_kv_buffer divides by the
layer's k_scale / v_scale before the cast). The scales come with every weight sync under SGLang's
names (`model.layers.i.self_attn.k_scale`), so the CPU loop measures what unit or calibrated
scales do to the rollout-vs-trainer mismatch."""

from __future__ import annotations

import torch
from transformers import DynamicCache

SCALE_LEAVES = ("k_scale", "v_scale")


def fake_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded through E4M3 at `scale` (x / scale cast to float8_e4m3fn, times scale), x's dtype."""
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def layer_of(name: str) -> tuple[int, int] | None:
    """(layer, 0 for k / 1 for v) of a `model.layers.i.self_attn.k_scale` name, else None."""
    leaf = name.rpartition(".")[2]
    if leaf not in SCALE_LEAVES or ".layers." not in name:
        return None
    return int(name.split(".layers.")[1].split(".")[0]), SCALE_LEAVES.index(leaf)


class Fp8KvCache(DynamicCache):
    """DynamicCache whose stored keys / values went through E4M3 at the layer's scales
    (scales[i] = [k_scale, v_scale])."""

    def __init__(self, scales: list[list[float]], **kwargs):
        super().__init__(**kwargs)
        self.scales = scales

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_scale, v_scale = self.scales[layer_idx]
        return super().update(fake_e4m3(key_states, k_scale), fake_e4m3(value_states, v_scale), layer_idx,
                              *args, **kwargs)
