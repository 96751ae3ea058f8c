"""The RL loop's parts: one step's phases, building a run, warm start, the colocated memory protocol, checkpoints."""
