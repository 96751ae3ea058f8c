"""DAPO's math reward as published (arXiv 2503.14476, DAPO-Math-17k): the answer is what follows the
last "Answer:" of the response's tail, normalized as Minerva normalizes final answers (Lewkowycz et
al. 2022, appendix D), and compared with the equally normalized gold answer as strings. Correct
scores +1, anything else -1 (a response without "Answer:" too): `dapo`. The same judgment as
0 / 1 for evaluation, where avg@k and pass@k expect rewards in [0, 1]: `dapo_accuracy`.

Behaviour follows verl's verl/utils/reward_score/math_dapo.py (compute_score, is_correct_minerva,
normalize_final_answer) without its later boxed fallback: DAPO's prompt asks for "Answer: $Answer".
"""

from __future__ import annotations

import re

TAIL_CHARS = 300  # only the response's end is searched (the longest MATH-500 answer has 159 characters)
INVALID = "[INVALID]"  # the prediction of a response without "Answer:"
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's final-answer normalization, applied in this order.
_REPLACED = ((r"an ", ""), (r"a ", ""), (r".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
             ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots")
_REWRITTEN = ((r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"),  # the first $...$ only
              (r"(\\text\{)(.*?)(\})", "\\2"), (r"(\\textbf\{)(.*?)(\})", "\\2"),
              (r"(\\overline\{)(.*?)(\})", "\\2"), (r"(\\boxed\{)(.*)(\})", "\\2"),
              (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
              (r"(sqrt)([^{])", "sqrt{\\2}"))  # \sqrta -> \sqrt{a}


def normalize_answer(text: str) -> str:
    """Minerva's normalized form of a final answer ("x = \\$1,000." -> "1000")."""
    text = text.split("=")[-1]
    for old, new in _REPLACED:
        text = text.replace(old, new)
    for unit in _DROPPED:
        text = text.replace(unit, "")
    for pattern, repl in _REWRITTEN:
        text = re.sub(pattern, repl, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_answer(response: str) -> str:
    """The normalized text after the last "Answer:" in the response's last TAIL_CHARS characters,
    INVALID when there is none."""
    found = _ANSWER_RE.findall(response[-TAIL_CHARS:])
    return normalize_answer(found[-1]) if found else INVALID


def dapo_reward(response: str, answer: str) -> dict:
    """+1 when the extracted answer equals the normalized gold answer, else -1; with "acc" (1 / 0,
    logged as reward/acc) and "pred" (maj@k votes on it)."""
    pred = extract_answer(response)
    correct = pred == normalize_answer(answer)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}


def dapo_accuracy(response: str, answer: str) -> dict:
    """dapo_reward's judgment scored 1 / 0 (evaluation: avg@k is then the accuracy)."""
    pred = extract_answer(response)
    return {"score": float(pred == normalize_answer(answer)), "pred": pred}


def extracted_or_none(response: str) -> str | None:
    """The answer maj@k votes on: extract_answer, None for INVALID (no vote)."""
    pred = extract_answer(response)
    return None if pred == INVALID else pred
