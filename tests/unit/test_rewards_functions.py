"""Reward functions against hand-computed values, and the registry."""

import pytest

from megatron_rl.rewards import exact_match, final_answer, get_reward_fn, math_verify_reward, position_match, register_reward_fn


@pytest.mark.parametrize(
    "response,answer,expected",
    [("12", "12", 1.0), (" 12\n", "12", 1.0), ("12", "21", 0.0), ("", "1", 0.0), ("1 2", "12", 0.0)],
)
def test_exact_match(response, answer, expected):
    assert exact_match(response, answer) == expected


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("12345", "12305", 4 / 5),
        ("123", "1234", 3 / 4),  # missing last char
        ("12345", "1234", 4 / 5),  # one too long
        ("", "12", 0.0),
        ("", "", 1.0),
        ("99", "12", 0.0),
    ],
)
def test_position_match(response, answer, expected):
    assert position_match(response, answer) == pytest.approx(expected)


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("The answer is 72.", "72", 1.0),
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("$0.5$", "\\frac{1}{2}", 1.0),
        ("$1+x^2$", "x^2+1", 1.0),
        ("\\boxed{73}", "72", 0.0),
        ("I do not know", "72", 0.0),
    ],
)
def test_math_verify(response, answer, expected):
    assert math_verify_reward(response, answer) == expected


def test_math_verify_unparsable_gold_raises():
    with pytest.raises(ValueError, match="gold answer"):
        math_verify_reward("1", "")


@pytest.mark.parametrize(
    "response,expected",
    [
        ("7+5=12,12+9=21:21", 1.0),
        ("7+5=13,13+9=22:21", 1.0),  # only the final answer is judged
        ("7+5=12,12+9=21:22", 0.0),
        (" 7+5=12:3:21 \n", 1.0),  # the last ':' counts; surrounding whitespace is ignored
        ("21", 1.0),  # no ':' at all: the whole response is the final answer
        ("7+5=12,12+9=21:", 0.0),
        ("7+5=12,12+9=21:21x", 0.0),
        ("7+5=12,12+9=21:2 1", 0.0),
        ("7+5=12,12+9=21:" + "9" * 40, 0.0),  # no giant ints parsed
        ("", 0.0),
        (":::", 0.0),
    ],
)
def test_final_answer(response, expected):
    assert final_answer(response, "7+5=12,12+9=21:21") == expected


def test_final_answer_rejects_a_gold_without_an_integer():
    with pytest.raises(ValueError, match="gold answer"):
        final_answer("21", "7+5=12:twelve")


def test_registry():
    assert get_reward_fn("exact_match") is exact_match
    assert get_reward_fn("math_verify") is math_verify_reward
    with pytest.raises(ValueError, match="unknown reward function 'f1'"):
        get_reward_fn("f1")

    def length(response, answer):
        return float(len(response))

    register_reward_fn("test_length", length)
    assert get_reward_fn("test_length")("abc", "") == 3.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward_fn("test_length", lambda r, a: 0.0)
