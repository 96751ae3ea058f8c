"""megatron_rl.rewards"""
