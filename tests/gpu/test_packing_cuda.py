"""Packing on CUDA tensors: the index tensors it builds must live on the batch's device (a CPU
arange beside CUDA lengths fails). CPU results are the reference."""

import pytest
import torch

from megatron_rl.actor.packing import as_sequences, pack_batch, unpack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_as_sequences_on_cuda_equals_cpu():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 0.0]])
    lens = torch.tensor([[2, 3]])
    expected = as_sequences(values, lens)
    got = as_sequences(values.cuda(), lens.cuda())
    assert got.is_cuda and got.cpu().tolist() == expected.tolist()


def test_packed_logprobs_come_back_on_cuda():
    tokens = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    packed, index = pack_batch({"tokens": tokens, "loss_mask": mask}, budget=8, multiple=4)
    expected = unpack(packed["loss_mask"], index)
    assert unpack(packed["loss_mask"].cuda(), index).cpu().tolist() == expected.tolist()
