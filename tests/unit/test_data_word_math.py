"""The word_math task: every answer re-derived from the prompt's text alone (an independent reader
of the six templates), math_verify's verdicts on real-looking responses, and the held-out split."""

import re
from collections import Counter

import pytest

from megatron_rl.config import load_config
from megatron_rl.data import get_task, make_task_dataset
from megatron_rl.data.word_math import BILLS
from megatron_rl.loop.evaluate import held_out_records
from megatron_rl.rewards import get_reward_fn


def solve(prompt: str) -> int:
    """Read the numbers and the question's shape from the text; compute the answer by hand's rules."""
    n = [int(x) for x in re.findall(r"\d+", prompt)]
    if "more" in prompt:
        return n[0] + n[1]
    if "gave" in prompt:
        return n[0] - n[1]
    if "Each of them holds" in prompt:
        return n[0] * n[1]
    if "equally among" in prompt:
        return n[0] // n[1]
    if "in total" in prompt:
        return n[0] + n[1] * n[2]
    if "change" in prompt:
        return n[2] - n[0] * n[1]
    raise AssertionError(f"unknown template: {prompt}")


def test_every_answer_follows_from_its_prompt():
    records = make_task_dataset("word_math", 600, seed=5)
    kinds = Counter()
    for r in records:
        assert r["prompt"].endswith("End your answer with 'The answer is N.'")
        assert r["answer"] == str(solve(r["prompt"])) and int(r["answer"]) >= 0
        kinds[next(k for k in ("more", "gave", "Each of", "equally", "in total", "change") if k in r["prompt"])] += 1
    assert len(kinds) == 6 and min(kinds.values()) > 60  # each template about a sixth
    assert len({r["prompt"] for r in records}) > 590  # few repeats
    assert records == make_task_dataset("word_math", 600, seed=5) != make_task_dataset("word_math", 600, seed=6)
    numbers = [int(x) for r in records for x in re.findall(r"\d+", r["prompt"]) if int(x) not in BILLS]
    assert max(numbers) <= 12 * 9  # max_number = 12 bounds factors; the largest stated total is a share's


def test_max_number_scales_the_problems_and_is_checked():
    big = make_task_dataset("word_math", 200, seed=1, max_number=50)
    assert max(int(r["answer"]) for r in big) > max(int(r["answer"]) for r in make_task_dataset("word_math", 200, seed=1))
    for bad in (2, 1001):
        with pytest.raises(ValueError, match=f"max_number={bad} must be in \\[3, 1000\\]"):
            make_task_dataset("word_math", 1, seed=1, max_number=bad)
    assert all(r["answer"] == str(solve(r["prompt"])) for r in make_task_dataset("word_math", 300, seed=2, max_number=1000))


@pytest.mark.parametrize("response, score", [
    ("Tom has 3 apples and 4 more apples, so he has 3 + 4 = 7 apples. The answer is 7.", 1.0),
    ("3 + 4 = 7 apples.", 1.0),
    ("The answer is 7.0", 1.0),
    ("He has 7 apples, 3 more than before. The answer is 10.", 0.0),
    ("Tom has 3 + 4 apples.", 1.0),  # math_verify evaluates the final expression
    ("I do not know.", 0.0),
])
def test_math_verify_scores_the_final_answer(response, score):
    spec = get_task("word_math")
    assert get_reward_fn(spec.reward_fn)(response, "7") == score
    assert spec.valid_format(response) == any(c.isdigit() for c in response)


def test_the_held_out_split_never_holds_a_training_prompt():
    cfg = load_config(None, ["data.task=word_math", "data.num_examples=300", "train.sft_steps=0"])
    train = {r["prompt"] for r in make_task_dataset("word_math", 300, seed=cfg.train.seed)}
    held = held_out_records(cfg, "word_math", 100)
    assert len(held) == 100 and not train & {r["prompt"] for r in held}
    assert all(r["answer"] == str(solve(r["prompt"])) for r in held)
