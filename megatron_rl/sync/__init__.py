"""megatron_rl.sync"""
