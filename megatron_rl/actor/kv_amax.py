"""Calibrated FP8 KV-cache scales: per-layer amax of the keys and values attention sees.

The trainer's old-log-prob forward runs on the tokens just sampled, which the engine sees again at
the next rollout: recording |K| and |V| there (after RoPE, as they enter core attention, which is
what SGLang writes into its KV cache) gives per-layer scales for the next sync at no extra forward.
NeMo-RL recalibrates each step the same way. SGLang stores K / k_scale in E4M3, so the scale that
maps the observed amax onto the format's largest value is amax / 448.

    calib = KvCalibration(num_layers, parallel)
    with calib.recording(actor.model):
        actor.compute_logprobs(batch, ...)
    calib.scales()     # [(k_scale, v_scale)] per layer, identical on every rank
"""

from __future__ import annotations

import contextlib

import torch

from megatron_rl import collectives

E4M3_MAX = 448.0
MIN_AMAX = 1e-6  # a layer never seen (or all-zero) keeps a finite, positive scale


class KvCalibration:
    """Running per-layer (k, v) amax of the last recorded forward, reduced over every rank."""

    def __init__(self, num_layers: int, parallel) -> None:
        self.parallel = parallel
        self.amax = torch.ones(num_layers, 2, dtype=torch.float64) * E4M3_MAX  # unit scales until recorded

    @contextlib.contextmanager
    def recording(self, model_chunks):
        """Hooks on every core attention of `model_chunks` for the block; at its end the amax is
        max-reduced over the model-parallel group (TP shards heads, PP stages layers) and then over
        data parallel (every replica's engine gets the same scales). Collective: all ranks enter it."""
        seen: dict[int, torch.Tensor] = {}  # on the device: one host copy at the end, not one per layer

        def hook(module, args):
            layer = module.layer_number - 1  # Megatron's global, 1-based layer number
            kv = torch.stack([args[1].detach().abs().amax().float(), args[2].detach().abs().amax().float()])
            seen[layer] = kv if layer not in seen else torch.maximum(seen[layer], kv)

        handles = [m.register_forward_pre_hook(hook) for m in _core_attentions(model_chunks)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
        local = torch.zeros_like(self.amax)
        for layer, kv in seen.items():
            local[layer] = kv.double().cpu()
        local = collectives.all_reduce(local, self.parallel.mp_group, op="max")
        self.amax = collectives.all_reduce(local, self.parallel.dp_group, op="max").clamp_min(MIN_AMAX)

    def scales(self) -> list[tuple[float, float]]:
        """[(k_scale, v_scale)] per layer: amax / 448 (1.0 before the first recording)."""
        return [(k / E4M3_MAX, v / E4M3_MAX) for k, v in self.amax.tolist()]


def _core_attentions(model_chunks) -> list[torch.nn.Module]:
    found = [m for chunk in model_chunks for name, m in chunk.named_modules()
             if name.endswith("self_attention.core_attention")]
    if not found:
        raise ValueError("no self_attention.core_attention module in the actor: cannot calibrate KV scales")
    return found
