"""Grade-school arithmetic word problems, generated with their answers (the `word_math` task).

Each problem is one of a few templates (add, take away, groups of, share equally, groups plus a
start, change from a payment) with random names, items and numbers; the answer is computed from
the same numbers, so it is right by construction, and every answer is a whole number >= 0 (a
share divides exactly, change never exceeds the payment). Numbers stay below `max_number` (factors)
so that a 135M-parameter instruct model gets some right and some wrong: GRPO needs both. Scored with
math_verify (the response's final number, "The answer is 7." or "3 + 4 = 7"), as GSM8K is.
"""

from __future__ import annotations

import random
import re
from typing import Callable

NAMES = ("Tom", "Sara", "Liam", "Mia", "Noah", "Emma", "Omar", "Ava", "Leo", "Zoe", "Ben", "Ivy")
ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "books", "shells", "stamps", "cards", "eggs")
CONTAINERS = ("boxes", "bags", "packs", "jars", "baskets")
BILLS = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # the smallest that pays: up to 5 x 1000 dollars
ASK = " End your answer with 'The answer is N.'"


def _add(rng: random.Random, n: int, name: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 3 * n), rng.randint(2, 3 * n)
    return f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", a + b


def _take_away(rng: random.Random, n: int, name: str, item: str) -> tuple[str, int]:
    b = rng.randint(2, 2 * n)
    a = b + rng.randint(1, 2 * n)
    friend = rng.choice([x for x in NAMES if x != name])
    return f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?", a - b


def _groups(rng: random.Random, n: int, name: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, n), rng.randint(2, n)
    box = rng.choice(CONTAINERS)
    return f"{name} buys {a} {box} of {item}. Each of them holds {b} {item}. How many {item} does {name} buy?", a * b


def _share(rng: random.Random, n: int, name: str, item: str) -> tuple[str, int]:
    each, people = rng.randint(2, n), rng.randint(2, min(n, 9))
    return (f"{name} shares {each * people} {item} equally among {people} friends. "
            f"How many {item} does each friend get?"), each


def _start_plus_groups(rng: random.Random, n: int, name: str, item: str) -> tuple[str, int]:
    start, a, b = rng.randint(1, 2 * n), rng.randint(2, min(n, 9)), rng.randint(2, min(n, 9))
    box = rng.choice(CONTAINERS)
    return (f"{name} has {start} {item}. Then {name} buys {a} {box} with {b} {item} in each. "
            f"How many {item} does {name} have in total?"), start + a * b


def _change(rng: random.Random, n: int, name: str, item: str) -> tuple[str, int]:
    price, count = rng.randint(2, n), rng.randint(2, 5)
    paid = next(bill for bill in BILLS if bill >= price * count)
    thing = item.rstrip("s")
    return (f"One {thing} costs {price} dollars. {name} buys {count} of them and pays with a {paid}-dollar bill. "
            f"How many dollars of change does {name} get?"), paid - price * count


TEMPLATES: tuple[Callable[[random.Random, int, str, str], tuple[str, int]], ...] = (
    _add, _take_away, _groups, _share, _start_plus_groups, _change)


def word_problem(rng: random.Random, max_number: int) -> tuple[str, str]:
    """(prompt, answer): one problem from a random template, its answer a whole number as text."""
    if not 3 <= max_number <= 1000:
        raise ValueError(f"word_math option max_number={max_number} must be in [3, 1000]")
    template = rng.choice(TEMPLATES)
    question, answer = template(rng, max_number, rng.choice(NAMES), rng.choice(ITEMS))
    assert answer >= 0 and isinstance(answer, int), (question, answer)
    return question + ASK, str(answer)


_NUMBER_RE = re.compile(r"\d")


def has_number(response: str) -> bool:
    """Format check: the response states some number (right or wrong)."""
    return _NUMBER_RE.search(response) is not None
