"""The Megatron-Core actor: parallel setup, HF weight I/O, log-probs and train steps (imports nothing heavy).

Use `from megatron_rl.actor.actor import MegatronActor` and `megatron_rl.actor.parallel` explicitly;
this package module stays free of Megatron imports so `import megatron_rl.actor` is cheap.
"""
