"""The memory plan against torch.cuda.max_memory_allocated on a real GPU (skipped without CUDA).

A Qwen3-shaped model, a few layers, BF16 parameters with the mixed-precision optimizer: after one
train step the allocated weights + gradient buffer + optimizer state must be what the plan says
within 5%, and the peak within the plan's trainer total (the local spec: its s x s attention scores count).
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_plan_bounds_the_measured_peak(tiny_hf_factory, single_parallel):
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.config import load_config
    from megatron_rl.models.hf_config import ModelSpec
    from megatron_rl.cluster.memory import trainer_memory

    hf_dir = tiny_hf_factory("qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                             vocab_size=32768, max_position_embeddings=4096)
    cfg = load_config(None, [f"model.hf_dir={hf_dir}", "parallel.transformer_impl=local", "train.micro_batch_size=1",
                             "data.max_prompt_len=64", "rollout.max_new_tokens=1984"])
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    actor = MegatronActor.build(hf_dir, parallel=single_parallel, params_dtype=torch.bfloat16)
    batch = {"tokens": torch.randint(0, 32768, (1, 2048)), "loss_mask": torch.ones(1, 2048)}
    actor.train_step(batch, lambda lp, ent, mb: ((lp * mb["loss_mask"]).sum() / 2048, {}),
                     micro_batch_size=1, logprob_chunk_size=cfg.train.logprob_chunk_size)
    state = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    plan = trainer_memory(cfg, ModelSpec.from_hf_config(hf_dir), dp=1, cuda=True)
    planned_state = plan["weights"] + plan["grads"] + plan["optimizer"]
    print({"measured_state": state, "planned_state": planned_state, "measured_peak": peak,
           "planned_total": sum(plan.values()) - plan["cuda_context"]})
    assert abs(state - planned_state) <= 0.05 * planned_state
    assert peak <= sum(plan.values()) - plan["cuda_context"]
