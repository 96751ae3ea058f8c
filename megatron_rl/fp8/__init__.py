"""megatron_rl.fp8"""
