"""Fisher's exact test against published values, the bootstrap interval against cases with a known
answer."""

import statistics

import pytest

from megatron_rl.telemetry.stats import bootstrap_diff_ci, fisher_exact


@pytest.mark.parametrize("table, p", [
    ((3, 4, 1, 4), 0.4857142857),  # Fisher's tea tasting, [[3, 1], [1, 3]]: 34/70
    ((2, 3, 0, 3), 0.4),           # 2/3 vs 0/3 surges (docs/reproduction.md): 0.4 by hand, 2 x 1/5
    ((6, 8, 1, 8), 0.04055944),    # 6/8 vs 1/8: R fisher.test(matrix(c(6, 2, 1, 7), 2)) = 0.04056
    ((0, 8, 0, 8), 1.0),
    ((8, 8, 0, 8), 2 / 12870),     # the two extreme tables of C(16, 8) = 12870
])
def test_fisher_exact_matches_published_values(table, p):
    assert fisher_exact(*table) == pytest.approx(p, rel=1e-6)
    a, n_a, b, n_b = table
    assert fisher_exact(b, n_b, a, n_a) == pytest.approx(p, rel=1e-6)  # symmetric in the arms


def test_fisher_exact_refuses_impossible_counts():
    with pytest.raises(ValueError, match="arm a has 9 events of 8 runs"):
        fisher_exact(9, 8, 0, 8)


def test_bootstrap_interval_of_constant_arms_is_the_difference():
    diff, low, high = bootstrap_diff_ci([0.3] * 8, [0.2] * 8)
    assert diff == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)


def test_bootstrap_interval_is_close_to_the_normal_interval_and_reproducible():
    a = [0.31, 0.25, 0.40, 0.28, 0.35, 0.22, 0.30, 0.37]
    b = [0.20, 0.18, 0.27, 0.15, 0.24, 0.21, 0.12, 0.26]
    diff, low, high = bootstrap_diff_ci(a, b, resamples=20_000)
    # the plug-in standard error (population variances, as the bootstrap resamples)
    se = (statistics.pvariance(a) / len(a) + statistics.pvariance(b) / len(b)) ** 0.5
    assert diff == pytest.approx(statistics.mean(a) - statistics.mean(b))
    assert low == pytest.approx(diff - 1.96 * se, abs=0.25 * se)
    assert high == pytest.approx(diff + 1.96 * se, abs=0.25 * se)
    assert bootstrap_diff_ci(a, b, resamples=20_000) == (diff, low, high)
    assert bootstrap_diff_ci(a, b, resamples=20_000, seed=1) != (diff, low, high)
