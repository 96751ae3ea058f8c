"""reduce_metrics: sums then one reduce then divide; derived std and ess; missing keys and empty denominators."""

import math

import pytest
import torch

from megatron_rl.algo.metrics import mean_and_square, metric, reduce_metrics


def test_sum_of_numerators_over_sum_of_denominators_not_mean_of_means():
    a = {"x": metric(10.0, 10.0)}  # mean 1 over 10 tokens
    b = {"x": metric(3.0, 1.0)}  # mean 3 over 1 token
    assert reduce_metrics([a, b])["x"] == pytest.approx(13.0 / 11.0)


def test_reducer_is_called_once_on_one_stacked_tensor():
    calls = []

    def fake_all_reduce(t):
        # stands for another rank holding the same sums: doubles numerators and denominators
        calls.append(tuple(t.shape))
        return t.mul_(2.0)

    dicts = [{"a": metric(1.0, 2.0), "b": metric(3.0, 4.0)}, {"a": metric(1.0, 2.0), "c": metric(5.0, 5.0)}]
    out = reduce_metrics(dicts, reduce=fake_all_reduce)
    assert calls == [(3, 2)]
    assert out == {"a": 0.5, "b": 0.75, "c": 1.0}


def test_other_rank_contributions_change_the_ratio_correctly():
    def add_other_rank(t):
        other = torch.tensor([[6.0, 2.0]], dtype=torch.float64)  # rank 1 holds 2 tokens summing to 6
        return t.add_(other)

    assert reduce_metrics([{"x": metric(1.0, 1.0)}], reduce=add_other_rank)["x"] == pytest.approx(7.0 / 3.0)


def test_std_from_sums_of_x_and_x_squared():
    values = torch.tensor([1.0, 2.0, 4.0, 7.0, 100.0])
    where = torch.tensor([True, True, True, True, False])
    first = mean_and_square("lr", values[:2], where[:2])
    second = mean_and_square("lr", values[2:], where[2:])
    out = reduce_metrics([first, second])
    mean = (1 + 2 + 4 + 7) / 4
    assert out["lr/mean"] == pytest.approx(mean)
    assert out["lr/std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in (1, 2, 4, 7)) / 4))


def test_ess_from_weight_moments():
    w = torch.tensor([0.5, 1.0, 2.0, 4.0])
    out = reduce_metrics([mean_and_square("is_weight", w, torch.ones(4, dtype=torch.bool))])
    assert out["ess"] == pytest.approx(w.sum().item() ** 2 / (4 * w.square().sum().item()))
    equal = reduce_metrics([mean_and_square("is_weight", torch.ones(3), torch.ones(3, dtype=torch.bool))])
    assert equal["ess"] == 1.0


def test_zero_denominator_gives_nan_and_empty_list_gives_empty_dict():
    assert math.isnan(reduce_metrics([{"clip/low_neg": metric(0.0, 0.0)}])["clip/low_neg"])
    assert reduce_metrics([]) == {}


def test_metric_packs_float64_pair_and_detaches():
    x = torch.tensor(2.0, requires_grad=True)
    m = metric(x * 3, 4)
    assert m.dtype == torch.float64 and m.shape == (2,) and not m.requires_grad
    assert m.tolist() == [6.0, 4.0]
