"""megatron_rl.algo"""
