"""Memory planning: per-GPU bytes of the trainer and the rollout server from config.json alone
(`megatron-rl plan`; docs/plan.md)."""
