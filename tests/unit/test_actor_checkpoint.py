"""Megatron distributed checkpoint (model + optimizer) on CPU: resume reproduces the next step bitwise."""

import pytest
import torch

from megatron_rl.actor.actor import MegatronActor


def batch(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, 128, (2, 10), generator=gen), "loss_mask": torch.ones(2, 10),
            "advantages": torch.randn(2, 10, generator=gen)}


def loss_fn(logprobs, entropy, mb):
    return -(logprobs * mb["advantages"] * mb["loss_mask"]).sum() / 20.0, {}


def test_resume_gives_the_same_next_step(qwen3_dir, single_parallel, tmp_path):
    first = MegatronActor.build(qwen3_dir, parallel=single_parallel, lr=1e-3)
    first.train_step(batch(0), loss_fn, micro_batch_size=1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first.save_checkpoint(ckpt)
    expected = first.train_step(batch(1), loss_fn, micro_batch_size=1)
    expected_weights = dict(first.export_hf_weights())

    resumed = MegatronActor.build(qwen3_dir, parallel=single_parallel, lr=1e-3)
    resumed.load_checkpoint(ckpt)
    got = resumed.train_step(batch(1), loss_fn, micro_batch_size=1)
    assert got["grad_norm"] == expected["grad_norm"] and got["loss"] == expected["loss"]
    for name, tensor in resumed.export_hf_weights():
        assert torch.equal(tensor, expected_weights[name]), name

    # Without the optimizer state (fresh Adam moments) the second step differs: the test can fail.
    fresh = MegatronActor.build(qwen3_dir, parallel=single_parallel, lr=1e-3)
    fresh.train_step(batch(0), loss_fn, micro_batch_size=1)
    fresh.optimizer.load_state_dict(
        MegatronActor.build(qwen3_dir, parallel=single_parallel, lr=1e-3).optimizer.state_dict())
    fresh.train_step(batch(1), loss_fn, micro_batch_size=1)
    differs = any(not torch.equal(t, expected_weights[n]) for n, t in fresh.export_hf_weights())
    assert differs


def test_load_checkpoint_missing_folder(qwen2_dir, single_parallel, tmp_path):
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel)
    with pytest.raises(ValueError, match="nothing_here"):
        actor.load_checkpoint(tmp_path / "nothing_here")
