"""GRPO / Dr. GRPO / leave-one-out advantages, DAPO dynamic sampling and overlong shaping, by hand."""

import math

import pytest
import torch

from megatron_rl.algo.advantages import dynamic_sampling_keep, grpo_advantages, overlong_penalty

SQRT3 = math.sqrt(1.0 / 3.0)  # unbiased std of [1, 0, 0, 1]


def test_grpo_std_normalised_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4)
    a = 0.5 / (SQRT3 + 1e-6)
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)
    assert adv.dtype == torch.float32 and adv.shape == (8,)


def test_grpo_three_sample_groups():
    adv = grpo_advantages(torch.tensor([0.0, 1.0, 2.0, 5.0, 5.0, 8.0]), 3, eps=0.0)
    # group 2: mean 6, unbiased std sqrt((1 + 1 + 4) / 2) = sqrt(3)
    s = math.sqrt(3.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 0.0, 1.0, -1 / s, -1 / s, 2 / s]), atol=1e-6)


def test_dr_grpo_has_no_std_division():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0]), 4, norm_by_std=False)
    assert torch.equal(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))


def test_leave_one_out_baseline_by_hand():
    rewards = torch.tensor([0.0, 1.0, 2.0])
    # baselines: (1 + 2) / 2 = 1.5, (0 + 2) / 2 = 1, (0 + 1) / 2 = 0.5
    assert torch.allclose(grpo_advantages(rewards, 3, leave_one_out=True, norm_by_std=False), torch.tensor([-1.5, 0.0, 1.5]))
    # with std (unbiased std of the group = 1)
    assert torch.allclose(grpo_advantages(rewards, 3, leave_one_out=True, eps=0.0), torch.tensor([-1.5, 0.0, 1.5]))
    four = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, leave_one_out=True, norm_by_std=False)
    assert torch.allclose(four, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_equal_rewards_give_zero_in_every_mode():
    rewards = torch.full((6,), 0.7)
    for kwargs in ({}, {"norm_by_std": False}, {"leave_one_out": True}, {"leave_one_out": True, "norm_by_std": False}):
        assert torch.allclose(grpo_advantages(rewards, 3, **kwargs), torch.zeros(6), atol=1e-6), kwargs


@pytest.mark.parametrize("rewards, group_size, match", [
    (torch.zeros(6), 1, "group_size"),
    (torch.zeros(7), 2, "multiple"),
    (torch.zeros(2, 4), 4, "1-D"),
])
def test_grpo_rejects_bad_input(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, group_size)


def test_dynamic_sampling_keeps_groups_with_varied_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5000001])
    keep = dynamic_sampling_keep(rewards, 4)
    expected = [True] * 4 + [False] * 8 + [True] * 4
    assert keep.tolist() == expected
    assert keep.dtype == torch.bool


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # expected length 20 - 4 = 16; penalty -(len - 16) / 4, floored at -factor
    got = overlong_penalty(lengths, max_response_len=20, buffer_len=4, penalty_factor=1.0)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = overlong_penalty(lengths, max_response_len=20, buffer_len=4, penalty_factor=0.5)
    assert torch.allclose(half, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    assert not torch.signbit(got[:2]).any()  # plain zeros, not -0.0


@pytest.mark.parametrize("buffer_len, factor", [(0, 1.0), (30, 1.0), (4, -1.0)])
def test_overlong_penalty_rejects_bad_knobs(buffer_len, factor):
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([5]), 20, buffer_len, factor)


def test_reinforce_baseline_by_hand_token_weighted_global_whitening():
    from megatron_rl.algo.advantages import reinforce_baseline_advantages

    # groups of 2: centred [0.5, -0.5, 0, 0]; token counts [1, 1, 2, 0] -> values 0.5, -0.5, 0, 0
    # over 4 tokens: mean 0, unbiased var (0.25 + 0.25) / 3 = 1/6 (the last sample counts no token)
    got = reinforce_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, torch.tensor([1, 1, 2, 0]))
    s = math.sqrt(1 / 6 + 1e-8)
    assert torch.allclose(got, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]), atol=1e-6)
    # a mean off zero is removed too: centred [1, -1] over 3 + 1 tokens -> mean 0.5, var (3*0.25 + 2.25) / 3 = 1
    got = reinforce_baseline_advantages(torch.tensor([2.0, 0.0]), 2, torch.tensor([3, 1]))
    assert torch.allclose(got, torch.tensor([0.5, -1.5]), atol=1e-6)
    calls = []
    reinforce_baseline_advantages(torch.tensor([2.0, 0.0]), 2, torch.tensor([3, 1]),
                                  reduce=lambda t: calls.append(t.dtype) or t)
    assert calls == [torch.float64]  # one all-reduce of the sums
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline"):
        reinforce_baseline_advantages(torch.tensor([1.0, 0.0]), 2, torch.tensor([1, 0]))
