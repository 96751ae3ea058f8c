"""Value tests of data/: the prompt text every combination of system prompt x prompt template x chat
template x template kwargs x prompt shape produces (an independent renderer of the same template),
word_math's change and sharing rules read back from the text, each built-in task's answer and
format check at its option boundaries, and check_prompt_file's verdict on the first row / schema.
Expected values are by hand or by the reference renderer here."""

from __future__ import annotations

import json
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.config import load_config
from megatron_rl.data import build_char_tokenizer, get_task, make_task_dataset
from megatron_rl.data.prompt_file import check_prompt_file
from megatron_rl.data.word_math import BILLS, NAMES
from megatron_rl.loop.build import build_dataset

# A chat template over the char alphabet: role initial, ':', content, ','; then the generation
# prompt and, when the kwarg says so, a no-thinking marker.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }},{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}n:{% endif %}"
)
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz:=+-, "
BOS = 1


def _ids(text: str) -> list[int]:
    return [4 + ALPHABET.index(c) for c in text]  # specials take ids 0..3


def _reference(prompt, system: str, template: str, chat: bool, no_think: bool):
    """(prompt_ids, prompt_text) as the data section documents them, or None for a skipped row."""
    def templated(p):
        return template.replace("{prompt}", p) if template else p

    if not chat:
        if not isinstance(prompt, str):
            return None  # a message list needs a chat template
        text = templated(prompt)
        text = f"{system}\n{text}" if system else text
        return [BOS] + [4 + ALPHABET.index(c) if c in ALPHABET else 3 for c in text], text
    messages = [("user", templated(prompt))] if isinstance(prompt, str) else [(m["role"], m["content"]) for m in prompt]
    if system and messages[0][0] != "system":
        messages.insert(0, ("system", system))
    body = "".join(f"{role[0]}:{content}," for role, content in messages) + "a:" + ("n:" if no_think else "")
    return [BOS] + _ids(body), "<s>" + body


PROMPTS = ["sort:21=",
           [{"role": "user", "content": "rev:9="}],
           [{"role": "system", "content": "own"}, {"role": "user", "content": "rev:9="}]]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(range(len(PROMPTS))), st.sampled_from(["", "be"]),
       st.sampled_from(["", "q:{prompt}=", "{prompt}{prompt}"]), st.booleans(), st.booleans())
def test_every_crossing_of_the_prompt_knobs_gives_the_documented_text(tmp_path_factory, which, system, template, chat,
                                                                      no_think):
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("d") / "d.jsonl"
    prompt = PROMPTS[which]
    rows = [{"prompt": prompt, "answer": "1"}, {"prompt": "add:1+2=", "answer": "3"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"data.path={path}", f"data.chat_template={str(chat).lower()}", f"data.system_prompt='{system}'",
                 f"data.prompt_template='{template}'"]
    if no_think:
        overrides.append("data.template_kwargs={enable_thinking: false}")
    if no_think and not chat:  # kwargs with no template to take them: refused at load, naming the key
        with pytest.raises(ValueError, match=r"config key 'data\.template_kwargs'"):
            load_config(None, overrides)
        return
    ds = build_dataset(load_config(None, overrides).data, tok, seed=0)
    expected = [r for r in (_reference(prompt, system, template, chat, no_think),
                            _reference("add:1+2=", system, template, chat, no_think)) if r is not None]
    assert [(d.prompt_ids, d.prompt_text) for d in ds] == expected
    assert [d.answer for d in ds] == (["1", "3"] if len(expected) == 2 else ["3"])


def _shares(prompt: str):
    m = re.search(r"shares (\d+) \w+ equally among (\d+) friends", prompt)
    return None if m is None else (int(m[1]), int(m[2]))


@pytest.mark.parametrize("max_number", [3, 12, 1000])
def test_word_math_pays_with_the_smallest_bill_and_shares_divide_exactly(max_number):
    records = make_task_dataset("word_math", 400, seed=3, max_number=max_number)
    seen = set()
    for r in records:
        p, answer = r["prompt"], int(r["answer"])
        if (m := re.search(r"costs (\d+) dollars\. (\w+) buys (\d+) of them and pays with a (\d+)-dollar bill", p)):
            price, count, paid = int(m[1]), int(m[3]), int(m[4])
            smallest = min(b for b in BILLS if b >= price * count)
            assert (paid, answer) == (smallest, paid - price * count) and 2 <= count <= 5 and 2 <= price <= max_number
            seen.add("change")
        elif (s := _shares(p)) is not None:
            total, people = s
            assert total == answer * people and 2 <= people <= min(max_number, 9) and 2 <= answer <= max_number
            seen.add("share")
        elif (m := re.search(r"(\w+) had (\d+) \w+ and gave (\d+) of them to (\w+)\.", p)):
            assert m[1] != m[4] and {m[1], m[4]} <= set(NAMES)  # the friend is somebody else
            assert answer == int(m[2]) - int(m[3]) >= 1
            seen.add("take")
    assert seen == {"change", "share", "take"}


def test_word_maths_format_check_wants_a_digit_and_math_verify_reads_the_final_number():
    from megatron_rl.rewards import get_reward_fn

    valid = get_task("word_math").valid_format
    assert [valid(t) for t in ("seven", "The answer is 7.", "x0", "")] == [False, True, True, False]
    score = get_reward_fn("math_verify")
    assert float(score("3 + 4 = 7. The answer is 7.", "7")) == 1.0
    assert float(score("The answer is 12.", "7")) == 0.0


@pytest.mark.parametrize("task, options, check", [
    ("sort", {"min_len": 1, "max_len": 1}, lambda d, a: len(d) == 1 and a == d),
    ("sort", {"min_len": 5, "max_len": 5}, lambda d, a: len(d) == 5 and a == "".join(sorted(d))),
    ("reverse", {"min_len": 2, "max_len": 4}, lambda d, a: 2 <= len(d) <= 4 and a == d[::-1]),
])
def test_digit_tasks_at_their_length_bounds(task, options, check):
    records = make_task_dataset(task, 50, seed=9, **options)
    for r in records:
        digits = r["prompt"].split(":", 1)[1].rstrip("=")
        assert check(digits, r["answer"]), r
    lengths = {len(r["prompt"].split(":", 1)[1]) - 1 for r in records}
    assert lengths == set(range(options["min_len"], options["max_len"] + 1))  # both bounds are drawn


@pytest.mark.parametrize("num_digits", [1, 3])
def test_add_has_exactly_num_digits_per_term_and_the_true_sum(num_digits):
    for r in make_task_dataset("add", 60, seed=4, num_digits=num_digits):
        a, b = r["prompt"].removeprefix("add:").rstrip("=").split("+")
        assert len(a) == len(b) == num_digits and (num_digits == 1 or a[0] != "0")
        assert r["answer"] == str(int(a) + int(b))


@pytest.mark.parametrize("num_terms, num_digits", [(2, 1), (5, 2)])
def test_chain_steps_are_running_sums_and_end_in_the_total(num_terms, num_digits):
    for r in make_task_dataset("chain", 30, seed=2, num_terms=num_terms, num_digits=num_digits):
        terms = [int(t) for t in r["prompt"].removeprefix("sum:").rstrip("=").split("+")]
        assert len(terms) == num_terms
        running, steps = terms[0], []
        for t in terms[1:]:
            steps.append(f"{running}+{t}={running + t}")
            running += t
        assert r["answer"] == ",".join(steps) + f":{running}"
        assert get_task("chain").valid_format(r["answer"])


@pytest.mark.parametrize("text, valid", [("0", False), ("00", False), ("05", False), ("20", True), ("198", True),
                                         ("1980", False), ("9", False), ("1a", False), ("", False)])
def test_adds_format_check_at_its_bounds(text, valid):
    assert get_task("add").valid_format(text) is valid  # 2..3 digits (a lone 0 is too short), no leading zero
    from megatron_rl.data.tasks import digit_string

    assert digit_string(1, 3, leading_zero=False)("0") and not digit_string(1, 3, leading_zero=False)("01")


def test_a_seed_draws_the_same_tasks_and_another_seed_others():
    for task in ("sort", "add", "chain", "word_math"):
        a = make_task_dataset(task, 20, seed=1)
        assert a == make_task_dataset(task, 20, seed=1) != make_task_dataset(task, 20, seed=2)
        assert make_task_dataset(task, 5, seed=1) == a[:5]  # a longer set extends a shorter one
    rng = random.Random(0)
    assert rng.random() == random.Random(0).random()


def _jsonl(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_first_object_row_decides_the_columns(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", "not json", "[1, 2]", {"q": "x", "meta": {"gt": None, "ans": "1"}},
                  {"prompt": "later rows are not read", "answer": "2"})
    check_prompt_file(path, {"data.prompt_key": "q", "data.answer_key": "meta.ans"}, "data.path")
    with pytest.raises(ValueError, match=r"config key 'data\.path': .* no data\.answer_key column 'meta\.gt'"):
        check_prompt_file(path, {"data.prompt_key": "q", "data.answer_key": "meta.gt"}, "data.path")  # null is absent
    shown = r"\(its first row has keys: \['meta', 'q'\]\)"
    with pytest.raises(ValueError, match=r"no data\.prompt_key column 'prompt' " + shown):
        check_prompt_file(path, {"data.prompt_key": "prompt"}, "data.path")
    blank = _jsonl(tmp_path / "b.jsonl", "", "[]", "oops")
    with pytest.raises(ValueError, match=r"config key 'eval\.datasets\[0\]\.path': .* has no rows"):
        check_prompt_file(blank, {}, "eval.datasets[0].path")


def test_parquet_columns_by_schema_and_an_empty_table_refused(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([{"p": "x", "rm": {"gt": "1", "style": "rule"}}]), path)
    check_prompt_file(path, {"k": "p", "a": "rm.gt"}, "data.path")
    with pytest.raises(ValueError, match=r"no a column 'rm\.truth'"):
        check_prompt_file(path, {"k": "p", "a": "rm.truth"}, "data.path")
    empty = tmp_path / "e.parquet"
    pq.write_table(pa.Table.from_pylist([{"p": "x"}]).slice(0, 0), empty)
    with pytest.raises(ValueError, match="has no rows"):
        check_prompt_file(empty, {"k": "p"}, "data.path")
