"""Trainer offload for colocated runs: memory really freed, reload bitwise, training continues identically."""

import pytest
import torch

from megatron_rl.actor.offload import StorageOffloader


def test_storage_offload_keeps_views_and_bytes():
    buffer = torch.arange(12, dtype=torch.float32)
    first, second = buffer[:4].view(2, 2), buffer[4:]
    offloader = StorageOffloader()
    assert offloader.offload([first, second, buffer]) == 48  # one storage, counted once
    assert buffer.untyped_storage().nbytes() == 0 and offloader.offloaded_bytes == 48
    assert offloader.reload() == 48
    assert first.tolist() == [[0.0, 1.0], [2.0, 3.0]] and second.tolist() == [4.0 + i for i in range(8)]
    first.add_(1)  # still a view of the same storage
    assert buffer[0].item() == 1.0


def _batch(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(4, 10)
    mask[:, 3:] = 1.0
    return {"tokens": torch.randint(0, 128, (4, 10), generator=gen), "loss_mask": mask,
            "advantages": torch.randn(4, 10, generator=gen)}


def _loss_fn(logprobs, entropy, mb):
    m = mb["loss_mask"]
    total = -(logprobs * mb["advantages"] * m).sum()
    return total / 28.0, {"n": torch.stack([total.detach().double(), m.sum().double()])}


def _state(actor) -> list[torch.Tensor]:
    tensors = [t for g in ("params", "grads", "optimizer") for t in actor._state_tensors(g)]
    return [t.detach().clone() for t in tensors]


def test_offload_reload_is_bitwise_and_training_continues_identically(qwen2_dir, single_parallel):
    from megatron_rl.actor.actor import MegatronActor

    runs = []
    for offload in (False, True):
        actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, lr=1e-2)
        actor.train_step(_batch(0), _loss_fn, micro_batch_size=2)
        before = _state(actor)
        if offload:
            freed = actor.offload(("grads", "optimizer"))
            freed += actor.offload(("params",))
            params = sum(p.numel() * 4 for p in actor.model[0].parameters())
            assert freed >= 4 * params  # FP32 weights + grads + two Adam moments
            assert all(p.untyped_storage().nbytes() == 0 for p in actor.model[0].parameters())
            assert actor.reload() == freed
            assert all(torch.equal(a, b) for a, b in zip(_state(actor), before))
        step = actor.train_step(_batch(1), _loss_fn, micro_batch_size=2)
        runs.append((step["loss"], step["grad_norm"], _state(actor)))
    (loss_a, norm_a, state_a), (loss_b, norm_b, state_b) = runs
    assert loss_a == loss_b and norm_a == norm_b
    assert all(torch.equal(a, b) for a, b in zip(state_a, state_b))
    with pytest.raises(ValueError, match="offload group"):
        actor.offload(("kv",))
