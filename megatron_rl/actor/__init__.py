"""megatron_rl.actor"""
