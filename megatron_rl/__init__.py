"""megatron_rl: FP8 reinforcement learning for LLMs on Megatron-Core with Calibrated Clipping.

Importing the package is cheap and side-effect free: Megatron-Core, Transformer Engine and SGLang
are imported only by the explicit build_*/init_* calls that need them.
"""

__version__ = "0.1.0"
