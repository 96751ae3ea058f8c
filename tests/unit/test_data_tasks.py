"""Character tokenizer and built-in tasks: ids by hand, answers re-derived independently."""

import re

import pytest
from transformers import AutoTokenizer

from megatron_rl.data import TASKS, build_char_tokenizer, get_task, load_char_tokenizer, make_task_dataset, sft_examples
from megatron_rl.rewards import final_answer, get_reward_fn

# Hand-written vocabulary: <pad>=0 <s>=1 </s>=2 <unk>=3, then '0'..'9' = 4..13, 'a'..'z' = 14..39,
# ':'=40 '='=41 '+'=42 '-'=43 ','=44 ' '=45.
HAND_IDS = {"s": 32, "o": 28, "r": 31, "t": 33, ":": 40, "3": 7, "1": 5, "=": 41, " ": 45, "a": 14, "z": 39}


def test_char_tokenizer_ids_by_hand():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 46
    assert tok("sort:31=")["input_ids"] == [1, 32, 28, 31, 33, 40, 7, 5, 41]
    assert tok("a z", add_special_tokens=False)["input_ids"] == [14, 45, 39]
    assert tok("a?", add_special_tokens=False)["input_ids"] == [14, 3]  # unknown char -> <unk>
    assert tok.decode([1, 32, 28, 31, 33, 45, 7, 2], skip_special_tokens=True) == "sort 3"


def test_char_tokenizer_save_load(tmp_path):
    build_char_tokenizer().save_pretrained(tmp_path)
    for tok in (load_char_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))):
        assert tok("rt:13")["input_ids"] == [1, 31, 33, 40, 5, 7]
        assert tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_char_tokenizer_rejects_duplicate_alphabet():
    with pytest.raises(ValueError, match="unique"):
        build_char_tokenizer("aab")


def _check_sort(prompt, answer):
    digits = re.fullmatch(r"sort:(\d+)=", prompt).group(1)
    # Counting sort by hand, independent of sorted().
    assert answer == "".join(d * digits.count(d) for d in "0123456789")
    return len(digits)


def _check_reverse(prompt, answer):
    digits = re.fullmatch(r"rev:(\d+)=", prompt).group(1)
    assert answer == "".join(digits[len(digits) - 1 - i] for i in range(len(digits)))
    return len(digits)


def _check_add(prompt, answer):
    a, b = re.fullmatch(r"add:(\d+)\+(\d+)=", prompt).groups()
    assert int(answer) == int(a) + int(b) and not answer.startswith("0")
    assert len(a) == len(b) == 2 and a[0] != "0" and b[0] != "0"
    return 3


def _check_chain(prompt, answer):
    terms = [int(t) for t in re.fullmatch(r"sum:(\d(?:\+\d)*)=", prompt).group(1).split("+")]
    steps, final = answer.split(":")
    running = terms[0]
    for step, term in zip(steps.split(","), terms[1:]):  # a running sum, one written step per term
        assert step == f"{running}+{term}={running + term}"
        running += term
    assert len(terms) == 4 and len(steps.split(",")) == 3 and int(final) == running == sum(terms)
    assert get_task("chain").valid_format(answer) and final_answer(answer, answer) == 1.0
    assert 19 <= len(answer) <= 25  # "0+0=0,0+0=0,0+0=0:0" .. "9+9=18,18+9=27,27+9=36:36"
    return 4


@pytest.mark.parametrize("task,check", [("sort", _check_sort), ("reverse", _check_reverse), ("add", _check_add),
                                        ("chain", _check_chain)])
def test_task_answers_are_correct(task, check):
    records = make_task_dataset(task, 200, seed=3)
    lengths = {check(r["prompt"], r["answer"]) for r in records}
    if task in ("sort", "reverse"):
        assert lengths == {3, 4, 5, 6}  # default min_len=3, max_len=6, all lengths appear in 200 draws
    assert len({r["prompt"] for r in records}) > 150  # not degenerate


def test_task_dataset_deterministic_and_options():
    assert make_task_dataset("sort", 20, seed=1) == make_task_dataset("sort", 20, seed=1)
    assert make_task_dataset("sort", 20, seed=1) != make_task_dataset("sort", 20, seed=2)
    short = make_task_dataset("reverse", 50, seed=0, min_len=2, max_len=2)
    assert all(len(r["answer"]) == 2 for r in short)
    big = make_task_dataset("add", 50, seed=0, num_digits=3)
    assert all(re.fullmatch(r"add:[1-9]\d\d\+[1-9]\d\d=", r["prompt"]) for r in big)
    chains = make_task_dataset("chain", 50, seed=0, num_terms=2, num_digits=2)
    assert all(re.fullmatch(r"sum:[1-9]\d\+[1-9]\d=", r["prompt"]) for r in chains)
    assert all(re.fullmatch(r"(\d+)\+(\d+)=(\d+):\3", r["answer"]) for r in chains)


@pytest.mark.parametrize("response,valid", [
    ("7+5=12,12+9=21:21", True),
    ("7+5=13,13+9=22:99", True),  # wrong arithmetic, right shape
    ("7+5=12:12\n", True),
    ("7+5=12,12+9=21", False),  # no final answer
    ("7+5=12,,12+9=21:21", False),
    ("7+5=12,12+9=21:21:21", False),
    ("7+5=12,12+=21:21", False),
    ("21", False),
    ("", False),
])
def test_chain_valid_format(response, valid):
    assert get_task("chain").valid_format(response) is valid


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: make_task_dataset("mul", 5, 0), "unknown task 'mul'"),
        (lambda: make_task_dataset("sort", 5, 0, num_digits=2), "num_digits"),
        (lambda: make_task_dataset("sort", 5, 0, min_len=4, max_len=3), "min_len"),
        (lambda: make_task_dataset("add", 5, 0, num_digits=0), "num_digits"),
        (lambda: make_task_dataset("add", 0, 0), "num_examples"),
        (lambda: make_task_dataset("chain", 5, 0, num_terms=1), "num_terms"),
    ],
)
def test_task_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_sft_examples_layout():
    tok = build_char_tokenizer()
    pairs = sft_examples("add", tok, num=10, seed=5)
    records = make_task_dataset("add", 10, seed=5)
    assert len(pairs) == 10
    for (prompt_ids, answer_ids), record in zip(pairs, records):
        assert prompt_ids[0] == 1 and answer_ids[-1] == 2
        assert 2 not in prompt_ids and answer_ids.count(2) == 1
        assert tok.decode(prompt_ids, skip_special_tokens=True) == record["prompt"]
        assert tok.decode(answer_ids, skip_special_tokens=True) == record["answer"]
    first_prompt = records[0]["prompt"]
    assert pairs[0][0] == [1] + [4 + "0123456789".index(c) if c.isdigit() else {"a": 14, "d": 17, ":": 40, "+": 42, "=": 41}[c] for c in first_prompt]


def test_task_rewards_registered():
    for spec in TASKS.values():
        assert get_reward_fn(spec.reward_fn)("123", "123") == 1.0
        assert get_reward_fn(spec.partial_reward_fn)("123", "124") == pytest.approx(2 / 3)
