"""DAPO refill's plan: which kept groups each DP rank trains, and when to sample another round."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.loop.refill import kept_rows, needs_more, plan


def algo(**kw):
    return SimpleNamespace(**{"dynamic_sampling": True, "max_gen_batches": 3, "on_max_gen_batches": "train", **kw})


def test_plan_takes_the_first_target_groups_in_round_rank_order():
    # round 0: rank 0 kept 3 groups, rank 1 kept 1; round 1: 3 and 4; target 8
    counts = [torch.tensor([3, 1]), torch.tensor([3, 4])]
    # by hand: r0 (3, 1) -> 4 taken, r1 rank 0 takes 3 -> 7, rank 1 takes the last 1 -> 8
    assert plan(counts, 8, dp_rank=0) == ([3, 3], 6, 8)
    assert plan(counts, 8, dp_rank=1) == ([1, 1], 6, 8)
    assert plan([torch.tensor([1, 0])], 8, dp_rank=1) == ([0], 1, 1)  # short: all of it
    assert plan([torch.tensor([0, 0])], 8, dp_rank=0) == ([0], 0, 0)  # nothing kept: skip


def test_kept_rows_are_whole_groups_in_order():
    keep = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)  # groups of 2: 1, 3, 4 kept
    assert kept_rows(keep, 2, 2).tolist() == [2, 3, 6, 7]
    assert kept_rows(keep, 2, 0).tolist() == []


def test_needs_more_until_target_or_the_limit():
    one = [torch.tensor([2, 1])]
    assert needs_more(algo(), 4, one, step=0)  # 3 < 4
    assert not needs_more(algo(), 3, one, step=0)  # full
    assert not needs_more(algo(dynamic_sampling=False), 4, one, step=0)
    assert not needs_more(algo(), 99, one * 3, step=0)  # 3 rounds = the limit: train on 9
    assert needs_more(algo(max_gen_batches=0), 999, one * 50, step=0)  # 0: no limit
    with pytest.raises(RuntimeError, match="algo.max_gen_batches=3"):
        needs_more(algo(on_max_gen_batches="fail"), 99, one * 3, step=0)


def test_at_the_limit_the_message_says_what_was_kept_and_what_to_change(caplog):
    three = [torch.tensor([1, 0])] * 3
    with caplog.at_level("WARNING", logger="megatron_rl.loop.refill"):
        assert not needs_more(algo(), 8, three, step=4)
    assert caplog.messages == ["step 4: 3 of 8 informative groups after algo.max_gen_batches=3 generation rounds: "
                               "training on those (algo.on_max_gen_batches=train)"]
    with pytest.raises(RuntimeError) as err:
        needs_more(algo(on_max_gen_batches="fail"), 8, three, step=4)
    assert str(err.value) == ("step 4: 3 of 8 informative groups after algo.max_gen_batches=3 generation rounds "
                              "(algo.on_max_gen_batches=fail): the prompts are too easy or too hard for the policy; "
                              "raise algo.max_gen_batches or set it to 0 (no limit)")


def test_a_plan_over_no_rounds_takes_nothing():
    assert plan([], 8, dp_rank=0) == ([], 0, 0)
