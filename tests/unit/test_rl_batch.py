"""Samples -> padded trainer batch, mini-batch split and masked padding rows, by hand."""

from dataclasses import dataclass

import torch

from megatron_rl.loop.batch import collate, mini_batches
from megatron_rl.loop.phases import pad_rows


@dataclass
class S:
    prompt_ids: list
    response_ids: list
    rollout_logprobs: list


def test_collate_aligns_everything_with_tokens():
    samples = [S([1, 5], [7, 8, 2], [-0.1, -0.2, -0.3]), S([1, 6, 6], [2], [-0.5])]
    batch = collate(samples, torch.tensor([1.5, -0.5]), pad_id=0)
    assert batch["tokens"].tolist() == [[1, 5, 7, 8, 2], [1, 6, 6, 2, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 0]]
    assert batch["advantages"].tolist() == [[0, 0, 1.5, 1.5, 1.5], [0, 0, 0, -0.5, 0]]
    assert torch.allclose(batch["rollout_logprobs"], torch.tensor(
        [[0, 0, -0.1, -0.2, -0.3], [0, 0, 0, -0.5, 0]]))
    assert batch["response_lengths"].tolist() == [3, 1]


def test_mini_batches_partition_the_rows():
    batch = {"tokens": torch.arange(10)[:, None], "loss_mask": torch.ones(10, 1)}
    parts = mini_batches(batch, 3, torch.Generator().manual_seed(0))
    assert [p["tokens"].shape[0] for p in parts] == [4, 3, 3]
    assert sorted(torch.cat([p["tokens"] for p in parts]).flatten().tolist()) == list(range(10))


def test_the_split_is_the_step_generators_whatever_the_global_rng():
    """Every DP rank (and a resumed run) must draw the same split: it comes from the step's seeded
    generator (the permutation torch draws from that seed, in 3 near-equal parts), never from the
    process's global RNG."""
    batch = {"tokens": torch.arange(10)[:, None]}
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        parts = mini_batches(batch, 3, torch.Generator().manual_seed(5))
        assert [p["tokens"].flatten().tolist() for p in parts] == [expected[:4], expected[4:7], expected[7:]]


def test_pad_rows_adds_fully_masked_rows():
    batch = {"tokens": torch.tensor([[3, 4], [5, 6], [7, 8]]), "loss_mask": torch.ones(3, 2),
             "advantages": torch.full((3, 2), 2.0)}
    padded, rows = pad_rows(batch, 4)
    assert rows == 3 and padded["tokens"].shape == (4, 2)
    assert padded["loss_mask"][3].tolist() == [0.0, 0.0] and padded["advantages"][3].tolist() == [0.0, 0.0]
    assert padded["tokens"][:3].tolist() == batch["tokens"].tolist()
    same, rows = pad_rows(batch, 3)
    assert same is batch and rows == 3
