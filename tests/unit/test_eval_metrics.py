"""avg@k, pass@k (unbiased, Chen et al. 2021) and maj@k against hand-computed values; answer extractors."""

import pytest

from megatron_rl.algo.eval_metrics import maj_at_k, parse_metric, pass_at_k, problem_scores
from megatron_rl.rewards import get_answer_extractor


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 0, 1, 0.0),                 # c = 0: nothing passes
    (5, 5, 3, 1.0),                 # c = n
    (5, 2, 1, 0.4),                 # k = 1: c / n
    (5, 2, 2, 1 - 3 / 10),          # 1 - C(3,2)/C(5,2)
    (4, 1, 4, 1.0),                 # k = n: any pass passes
    (4, 0, 4, 0.0),
    (10, 3, 5, 1 - 21 / 252),       # 1 - C(7,5)/C(10,5)
    (1000, 1, 1, 0.001),            # large n: no overflow, exact to rounding
    (200, 100, 100, 1 - 1 / 90548514656103281165404177077484163874504589675413336841320),  # C(100,100)/C(200,100)
])
def test_pass_at_k_matches_the_binomial_formula(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_majority_vote_picks_the_most_frequent_answer():
    assert maj_at_k(["12", "13", "12", "14"], [1.0, 0.0, 1.0, 0.0], k=4) == 1.0
    assert maj_at_k(["13", "12", "13", "13"], [0.0, 1.0, 0.0, 0.0], k=4) == 0.0


def test_majority_tie_scores_the_mean_of_the_tied_answers():
    # "12" (right) and "13" (wrong) have two votes each: a random tie break is right half the time
    assert maj_at_k(["12", "13", "13", "12"], [1.0, 0.0, 0.0, 1.0], k=4) == 0.5
    # three-way tie of one vote each, one right
    assert maj_at_k(["a", "b", "c"], [0.0, 1.0, 0.0], k=3) == pytest.approx(1 / 3)


def test_majority_uses_the_first_k_samples_and_skips_missing_answers():
    assert maj_at_k(["12", "13", "13"], [1.0, 0.0, 0.0], k=1) == 1.0
    assert maj_at_k([None, "13", None, None], [1.0, 0.0, 1.0, 1.0], k=4) == 0.0  # None never votes
    assert maj_at_k([None, None], [1.0, 1.0], k=2) == 0.0


def test_problem_scores_k_equals_n_and_avg_is_the_mean():
    rewards, answers = [1.0, 0.0, 0.0, 1.0], ["1", "2", "3", "1"]
    out = problem_scores(["avg@4", "pass@4", "pass@1", "maj@4"], rewards, answers)
    assert out == {"avg@4": 0.5, "pass@4": 1.0, "pass@1": 0.5, "maj@4": 1.0}
    assert "maj@4" not in problem_scores(["maj@4"], rewards, None)  # no extractor: left out


def test_partial_credit_does_not_pass():
    assert problem_scores(["pass@2", "avg@2"], [0.5, 0.8], None) == {"pass@2": 0.0, "avg@2": pytest.approx(0.65)}


@pytest.mark.parametrize("bad", ["avg@0", "best@4", "pass@", "avg4", "maj@-1", "pass@4 "])
def test_unknown_metric_names_are_refused(bad):
    with pytest.raises(ValueError, match="unknown metric"):
        parse_metric(bad)


def test_answer_extractors_of_the_built_in_rewards():
    assert get_answer_extractor("exact_match")("  123 ") == "123"
    assert get_answer_extractor("exact_match")("  ") is None
    assert get_answer_extractor("final_answer")("7+5=12,12+9=21:21") == "21"
    assert get_answer_extractor("final_answer")("7+5=12,12+9=21:2x") is None
    math = get_answer_extractor("math_verify")
    assert math("so the answer is \\boxed{\\frac{1}{2}}") == math("The answer is $0.5$")
    assert get_answer_extractor("my_module.my_reward") is None
