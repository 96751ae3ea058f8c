"""HF <-> Megatron-Core model mapping: configs (hf_config), name map and reshapes, layer specs, RoPE."""
