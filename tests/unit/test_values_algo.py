"""Value tests of algo/: each estimator against a slow reference written from its paper's formula
(plain Python loops, `statistics`, brute-force enumeration), on inputs where the quantities that a
wrong denominator or tie rule would confuse differ (several groups, G > 2, partial credit, ties)."""

import itertools
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.advantages import grpo_advantages, overlong_penalty, reinforce_baseline_advantages
from megatron_rl.algo.eval_metrics import maj_at_k, pass_at_k, problem_scores
from megatron_rl.algo.loss_spec import LossSpec
from megatron_rl.algo.metrics import masked_metric, metric, reduce_metrics

REWARD = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, -1.0])
FAST = settings(max_examples=25, deadline=None)


def _grpo_reference(rewards, g, norm, loo):
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start:start + g]
        if max(group) == min(group):
            out += [0.0] * g
            continue
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1:]
            a = r - (sum(others) / (g - 1) if loo else sum(group) / g)
            out.append(a / (statistics.stdev(group) + 1e-6) if norm else a)
    return out


@FAST
@given(st.integers(2, 5), st.integers(1, 3), st.booleans(), st.booleans(), st.data())
def test_grpo_and_rloo_match_the_per_sample_formula(g, groups, norm, loo, data):
    rewards = data.draw(st.lists(REWARD, min_size=g * groups, max_size=g * groups))
    got = grpo_advantages(torch.tensor(rewards), g, norm_by_std=norm, leave_one_out=loo).tolist()
    assert got == pytest.approx(_grpo_reference(rewards, g, norm, loo), abs=1e-5)


@FAST
@given(st.integers(2, 4), st.data())
def test_reinforce_baseline_whitens_with_the_unbiased_token_weighted_variance(g, data):
    rewards = data.draw(st.lists(REWARD, min_size=2 * g, max_size=2 * g))
    tokens = data.draw(st.lists(st.integers(0, 3), min_size=2 * g, max_size=2 * g))
    if sum(tokens) < 2:
        tokens[0] += 2
    centred = [r - statistics.fmean(rewards[s - s % g:s - s % g + g]) for s, r in enumerate(rewards)]
    per_token = [c for c, n in zip(centred, tokens) for _ in range(n)]
    mu, var = statistics.fmean(per_token), statistics.variance(per_token)
    expected = [(c - mu) / math.sqrt(var + 1e-8) for c in centred]
    got = reinforce_baseline_advantages(torch.tensor(rewards), g, torch.tensor(tokens)).tolist()
    # relative too: a zero-variance token set divides by sqrt(1e-8), giving values near 1e4 in float32
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("max_len, buffer, factor", [(20, 4, 1.0), (16, 16, 0.5), (10, 1, 2.0)])
def test_overlong_penalty_at_every_length_and_both_ends_of_the_buffer(max_len, buffer, factor):
    lengths = list(range(0, max_len + 3))
    expected = []
    for n in lengths:  # DAPO eq. 13
        if n <= max_len - buffer:
            expected.append(0.0)
        elif n <= max_len:
            expected.append((max_len - buffer - n) / buffer * factor)
        else:
            expected.append(-factor)
    got = overlong_penalty(torch.tensor(lengths), max_len, buffer, factor).tolist()
    assert got == pytest.approx(expected, abs=1e-6)


def _pass_brute(rewards, k):
    """P(at least one of k samples drawn without replacement is full credit), by enumeration."""
    subsets = list(itertools.combinations(rewards, k))
    return sum(any(r >= 1.0 for r in s) for s in subsets) / len(subsets)


def _maj_brute(answers, rewards, k):
    """Expected reward of the majority answer under a uniformly random tie break."""
    votes = {}
    for a in answers[:k]:
        if a is not None:
            votes[a] = votes.get(a, 0) + 1
    if not votes:
        return 0.0
    top = [a for a, c in votes.items() if c == max(votes.values())]
    return statistics.fmean(statistics.fmean(r for b, r in zip(answers[:k], rewards[:k]) if b == a) for a in top)


@FAST
@given(st.integers(1, 6), st.data())
def test_pass_avg_and_maj_at_k_against_enumeration(n, data):
    rewards = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=n, max_size=n))
    answers = data.draw(st.lists(st.sampled_from(["1", "2", "3", None]), min_size=n, max_size=n))
    k = data.draw(st.integers(1, n))
    got = problem_scores([f"avg@{k}", f"pass@{k}", f"maj@{k}"], rewards, answers)
    assert got[f"avg@{k}"] == pytest.approx(sum(rewards) / n)
    assert got[f"pass@{k}"] == pytest.approx(_pass_brute(rewards, k))
    assert got[f"maj@{k}"] == pytest.approx(_maj_brute(answers, rewards, k))


def test_maj_tie_between_two_answers_is_their_mean_and_later_votes_beyond_k_do_not_count():
    answers, rewards = ["7", "8", "8", "8"], [1.0, 0.0, 0.0, 0.0]
    assert maj_at_k(answers, rewards, 2) == 0.5  # one vote each: mean of 1 and 0, whichever came first
    assert maj_at_k(["8", "7"], [0.0, 1.0], 2) == 0.5
    assert maj_at_k(answers, rewards, 1) == 1.0  # "8"'s later votes are outside k = 1
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0


def test_metric_payload_order_does_not_depend_on_insertion_order():
    """Two ranks build their dicts in different orders; the reducer sums position by position, so the
    payload layout must be the keys' sorted order on every rank."""
    a = {"x": metric(1.0, 1.0), "y": metric(10.0, 2.0)}
    b = {"y": metric(30.0, 2.0), "x": metric(3.0, 1.0)}
    seen = []

    def reduce(payload):  # what an all_reduce over the two ranks returns: rank a's + rank b's
        seen.append(payload.clone())
        return payload + torch.stack([b[k] for k in sorted(b)])

    assert reduce_metrics([a], reduce) == {"x": 2.0, "y": 10.0}
    assert seen[0].tolist() == [[1.0, 1.0], [10.0, 2.0]]


def test_masked_metric_divides_by_the_selected_count():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    where = torch.tensor([[True, False, True], [False, False, True]])
    assert masked_metric(values, where).tolist() == [10.0, 3.0]


@pytest.mark.parametrize("low, high, ok", [(0.0, 0.1, True), (0.8, 0.8, False), (0.9, 0.8, False),
                                           (-0.1, 1.2, False), (0.8, 1.2, True)])
def test_loss_spec_bounds_at_the_boundary(low, high, ok):
    if ok:
        assert LossSpec(clip_low=low, clip_high=high).clip_high == high
    else:
        with pytest.raises(ValueError, match="clip_low"):
            LossSpec(clip_low=low, clip_high=high)


def _weights_reference(d_rows, lengths, level, clip):
    out = []
    for d, n in zip(d_rows, lengths):
        if level == "token":
            w = [math.exp(x) for x in d[:n]]
        else:
            s = sum(d[:n]) / (n if level == "geo_mean" else 1)
            w = [math.exp(s)] * n
        out.append([min(x, clip) for x in w] + [1.0] * (len(d) - n))
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geo_mean"])
def test_importance_weights_by_level_over_rows_of_unequal_length(level):
    from megatron_rl.algo.rollout_correction import importance_weights

    d_rows = [[0.1, -0.2, 0.4, 0.3], [0.5, 0.2, 0.0, 0.0]]  # row 2 has 2 valid tokens of 4
    lengths = [4, 2]
    old = torch.tensor(d_rows, dtype=torch.float64)
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    w, m = importance_weights(old, torch.zeros_like(old), valid, tis_clip=1.5, level=level)
    w = torch.where(valid, w, 1.0)
    expected = _weights_reference(d_rows, lengths, level, 1.5)
    assert w.flatten().tolist() == pytest.approx([x for row in expected for x in row], rel=1e-6)
    raw = _weights_reference(d_rows, lengths, level, math.inf)
    truncated = sum(x > 1.5 for row, n in zip(raw, lengths) for x in row[:n])
    assert m["tis_clipfrac"].tolist() == [float(truncated), 6.0]  # over the 6 valid tokens


def test_icepop_and_rejection_bounds_are_inclusive():
    from megatron_rl.algo.rollout_correction import importance_weights, rejection_mask

    old = torch.tensor([[0.0, math.log(4.0), -1.0]], dtype=torch.float64)
    valid = torch.ones(1, 3, dtype=torch.bool)
    w, _ = importance_weights(old, torch.zeros_like(old), valid, mode="icepop", icepop_low=1.0, icepop_high=3.0)
    assert w.tolist() == [[1.0, 0.0, 0.0]]  # w = 1 sits on the lower bound: kept
    kept, m = rejection_mask(old, torch.zeros_like(old), valid, threshold=1.0, threshold_low=1.0)
    assert kept.tolist() == [[True, False, False]]  # k1 = 0 = log(1) on both bounds
    assert m["rollout_rs_masked_fraction"].tolist() == [2.0, 3.0]


@FAST
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=6), st.sampled_from(["k1", "k2", "k3"]))
def test_kl_estimators_match_schulmans_formulas(deltas, kl_type):
    from megatron_rl.algo.kl import kl_estimate

    ref = torch.tensor(deltas, dtype=torch.float64)
    got = kl_estimate(torch.zeros_like(ref), ref, kl_type).tolist()
    formula = {"k1": lambda d: -d, "k2": lambda d: d * d / 2, "k3": lambda d: math.exp(d) - 1 - d}[kl_type]
    assert got == pytest.approx([formula(d) for d in deltas], abs=1e-9)
