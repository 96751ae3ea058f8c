"""Rollout engines behind one protocol (design.md section 5): the embedded torch engine here."""

from megatron_rl.rollout.base import RolloutEngine, Sample, SamplingParams, tensor_digest
from megatron_rl.rollout.torch_engine import TorchRolloutEngine

__all__ = ["RolloutEngine", "Sample", "SamplingParams", "TorchRolloutEngine", "tensor_digest"]
