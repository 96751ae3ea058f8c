"""Built-in verifiable tasks (sort, reverse, add, chain) for the tiny CPU demo, with SFT warm-start data.

Prompts are short character strings for the character tokenizer (`char_tokenizer.py`):

    sort:31415=   -> 11345      (sort the digits ascending)
    rev:31415=    -> 51413      (reverse the digits)
    add:47+38=    -> 85         (sum of two n-digit numbers, no leading zeros)
    sum:7+5+9+3=  -> 7+5=12,12+9=21,21+3=24:24   (worked running sum, final answer after the last ':')

After ~100 SFT steps a 0.4M-parameter model gets about half of sort / reverse exactly right
(docs/data.md has the measurements), so GRPO groups have reward variance from the first step;
add is the harder task. `exact_match` is each task's reward; `position_match` (fraction of
correct characters) is the partial-credit option; `valid_format` says whether a response is
well-formed at all (its failure rate is the run's health/garbled_rate, docs/health.md).
chain is the long-answer task (19-25 characters) rewarded on its final answer only
(`final_answer`); it writes only characters of the tokenizer's original alphabet (no ';' or '#'),
so adding it changed no token id and no other task's model.
word_math (word_math.py) is the odd one out: English grade-school word problems for a real
pretrained model's own tokenizer and chat template, scored with math_verify.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from megatron_rl.data.word_math import has_number, word_problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _non_empty(text: str) -> bool:
    return bool(text.strip())


@dataclass(frozen=True)
class TaskSpec:
    """One built-in task: an example generator, the names of its reward functions and its format check."""

    name: str
    make_example: Callable[..., tuple[str, str]]  # (rng, **options) -> (prompt, answer)
    defaults: dict[str, int] = field(default_factory=dict)  # option name -> default value
    reward_fn: str = "exact_match"  # name in megatron_rl.rewards registry
    partial_reward_fn: str = "position_match"
    valid_format: Callable[[str], bool] = _non_empty
    """Is a decoded response (special tokens such as eos dropped) well-formed for the task, right or
    wrong? Its failure rate is health/garbled_rate (docs/health.md). Default: any non-blank text."""


def digit_string(min_len: int, max_len: int, leading_zero: bool = True) -> Callable[[str], bool]:
    """Format check: only ASCII digits, min_len <= length <= max_len, and no leading zero when
    `leading_zero` is False (a lone "0" is always allowed)."""

    def valid(text: str) -> bool:
        if not (min_len <= len(text) <= max_len and text.isascii() and text.isdigit()):
            return False
        return leading_zero or text == "0" or text[0] != "0"

    return valid


def _digits(rng: random.Random, min_len: int, max_len: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))


def _sort_example(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str]:
    digits = _digits(rng, min_len, max_len)
    return f"sort:{digits}=", "".join(sorted(digits))


def _reverse_example(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str]:
    digits = _digits(rng, min_len, max_len)
    return f"rev:{digits}=", digits[::-1]


def _add_example(rng: random.Random, num_digits: int) -> tuple[str, str]:
    low, high = 10 ** (num_digits - 1), 10**num_digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    return f"add:{a}+{b}=", str(a + b)


def _chain_example(rng: random.Random, num_terms: int, num_digits: int) -> tuple[str, str]:
    low, high = (0 if num_digits == 1 else 10 ** (num_digits - 1)), 10**num_digits - 1
    terms = [rng.randint(low, high) for _ in range(num_terms)]
    steps, total = [], terms[0]
    for term in terms[1:]:
        steps.append(f"{total}+{term}={total + term}")
        total += term
    return "sum:" + "+".join(map(str, terms)) + "=", ",".join(steps) + f":{total}"


_CHAIN_RE = re.compile(r"\d+\+\d+=\d+(,\d+\+\d+=\d+)*:\d+", re.ASCII)


def chain_valid_format(response: str) -> bool:
    """A worked chain `a+b=c,c+d=e:e` (digits only, at least one step), arithmetic not checked."""
    return _CHAIN_RE.fullmatch(response.strip()) is not None


# Format checks follow the default options, the ones an RL run generates (the data section has no
# option keys): sort / reverse answers have the prompt's 3..6 digits; the sum of two 2-digit
# numbers has 2 or 3 digits (20..198) and no leading zero; a chain has the
# worked shape whatever its options.
TASKS: dict[str, TaskSpec] = {
    "sort": TaskSpec("sort", _sort_example, {"min_len": 3, "max_len": 6}, valid_format=digit_string(3, 6)),
    "reverse": TaskSpec("reverse", _reverse_example, {"min_len": 3, "max_len": 6},
                        valid_format=digit_string(3, 6)),
    "add": TaskSpec("add", _add_example, {"num_digits": 2}, valid_format=digit_string(2, 3, leading_zero=False)),
    "chain": TaskSpec("chain", _chain_example, {"num_terms": 4, "num_digits": 1}, reward_fn="final_answer",
                      valid_format=chain_valid_format),
    "word_math": TaskSpec("word_math", word_problem, {"max_number": 12}, reward_fn="math_verify",
                          valid_format=has_number),
}


def get_task(task: str) -> TaskSpec:
    """Look up a built-in task by name; ValueError lists the known names."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {sorted(TASKS)}")
    return TASKS[task]


def _resolve_options(spec: TaskSpec, options: dict[str, int]) -> dict[str, int]:
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for task {spec.name!r}; known: {sorted(spec.defaults)}")
    merged = {**spec.defaults, **options}
    for key, value in merged.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"task {spec.name!r} option {key}={value!r} must be a positive int")
    if merged.get("num_terms", 2) < 2:
        raise ValueError(f"task {spec.name!r} option num_terms={merged['num_terms']} must be >= 2 (one step at least)")
    if merged.get("min_len", 0) > merged.get("max_len", 1 << 30):
        raise ValueError(f"task {spec.name!r}: min_len={merged['min_len']} > max_len={merged['max_len']}")
    return merged


def make_task_dataset(task: str, num_examples: int, seed: int, **options: int) -> list[dict[str, str]]:
    """Generate `num_examples` records {"prompt": str, "answer": str}, deterministic in `seed`.

    `options` override the task's defaults (sort/reverse: min_len, max_len; add: num_digits;
    chain: num_terms, num_digits).
    The records feed `PromptDataset.from_records` directly.
    """
    spec = get_task(task)
    opts = _resolve_options(spec, options)
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    rng = random.Random(seed)
    records = []
    for _ in range(num_examples):
        prompt, answer = spec.make_example(rng, **opts)
        records.append({"prompt": prompt, "answer": answer})
    return records


def sft_examples(
    task: str, tokenizer: "PreTrainedTokenizerBase", num: int, seed: int, **options: int
) -> list[tuple[list[int], list[int]]]:
    """Tokenized warm-start pairs: (prompt_ids with bos, answer_ids followed by eos_token_id).

    The loss of an SFT warm start is taken on the answer ids only; appending eos teaches the model
    to stop, which the rollout engine then sees as finish_reason "stop".
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token; SFT targets need one to teach stopping")
    pairs = []
    for record in make_task_dataset(task, num, seed, **options):
        prompt_ids = tokenizer(record["prompt"])["input_ids"]
        answer_ids = tokenizer(record["answer"], add_special_tokens=False)["input_ids"]
        pairs.append((list(prompt_ids), list(answer_ids) + [tokenizer.eos_token_id]))
    return pairs
