"""Checkpoint conversion: HF safetensors <-> Megatron-Core torch_dist, and HF -> HF FP8 (docs/convert.md)."""
