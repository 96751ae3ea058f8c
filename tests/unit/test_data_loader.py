"""PromptLoader at its edges: the smallest batch and dataset, the first epoch's order (rebuilt here
from the documented seed string), and resume positions at both ends of an epoch."""

from __future__ import annotations

import random

import pytest

from megatron_rl.data.loader import PromptLoader


def _order(seed: int, epoch: int, n: int) -> list[int]:
    """Reference: the permutation the docstring promises, seeded by (seed, epoch)."""
    order = list(range(n))
    random.Random(f"prompt-loader:{seed}:{epoch}").shuffle(order)
    return order


def test_the_smallest_batch_and_dataset_are_accepted():
    loader = PromptLoader(["only"], batch_size=1, seed=0)
    assert [loader.next_batch() for _ in range(3)] == [["only"]] * 3
    assert loader.state_dict()["epoch"] == 2


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1, got 0$"):
        PromptLoader(["a"], batch_size=0, seed=0)
    with pytest.raises(ValueError, match=r"^PromptLoader needs a non-empty dataset$"):
        PromptLoader([], batch_size=1, seed=0)


def test_a_fresh_loader_starts_at_epoch_0_in_its_seeded_order():
    data = list(range(7))
    loader = PromptLoader(data, batch_size=3, seed=5)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["position"] == 0
    first, second = _order(5, 0, 7), _order(5, 1, 7)
    assert loader.next_batch() == first[:3]
    assert loader.next_batch() == first[3:6]
    assert loader.next_batch() == first[6:] + second[:2]  # crosses into epoch 1


@pytest.mark.parametrize("position", [0, 7])
def test_resume_at_either_end_of_an_epoch(position):
    data = list(range(7))
    loader = PromptLoader(data, batch_size=3, seed=5)
    loader.load_state_dict({"epoch": 2, "position": position, "seed": 5, "shuffle": True, "num_items": 7})
    orders = _order(5, 2, 7) + _order(5, 3, 7)
    assert loader.next_batch() == orders[position: position + 3]


def test_bad_resume_states_are_refused_by_name():
    loader = PromptLoader(list(range(7)), batch_size=3, seed=5)
    with pytest.raises(ValueError, match=r"^loader state position=8 out of range$"):
        loader.load_state_dict({"epoch": 0, "position": 8, "seed": 5, "shuffle": True, "num_items": 7})
    with pytest.raises(ValueError, match=r"^loader state num_items=6 != dataset size 7: the dataset changed "
                                         r"since the checkpoint$"):
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": 5, "shuffle": True, "num_items": 6})


def test_iterating_gives_the_same_batches_as_next_batch():
    a, b = PromptLoader(list(range(5)), batch_size=2, seed=1), PromptLoader(list(range(5)), batch_size=2, seed=1)
    batches = iter(a)
    assert [next(batches) for _ in range(4)] == [b.next_batch() for _ in range(4)]
