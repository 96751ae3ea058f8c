"""The cluster side: placement of servers and ranks, the multi-node launch, the memory planner (`megatron-rl plan`)."""
