"""DAPO's reward (rewards/dapo.py) on hand-checked responses, and the DAPO recipe, examples/data/prepare.py
and the reward agreeing on fixtures with the published columns of DAPO-Math-17K and AIME."""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import load_config
from megatron_rl.data import build_char_tokenizer
from megatron_rl.loop.build import build_dataset, read_prompts
from megatron_rl.rewards import get_answer_extractor, get_reward_fn
from megatron_rl.rewards.dapo import normalize_answer

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "examples/data/prepare.py")
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)

# (response, gold, expected score, expected pred), each worked by hand from Minerva's normalization.
CASES = [
    ("2 + 2 = 4, so\nAnswer: 4", "4", 1.0, "4"),
    ("Answer: 5", "4", -1.0, "5"),
    ("the answer is \\boxed{4}", "4", -1.0, "[INVALID]"),  # strict: no "Answer:", no boxed fallback
    ("answer:   \\boxed{34}", "34", 1.0, "34"),  # any case; \boxed{} inside the answer is unwrapped
    ("Answer: $1,000$", "1000", 1.0, "1000"),  # the $...$ content, thousands commas dropped
    ("Answer: x = 12", "12", 1.0, "12"),  # the right-hand side of the last '='
    ("Answer: 5 units", "5", 1.0, "5"),  # spaces and the unit word removed
    ("Answer: 90^\\circ", "90", 1.0, "90"),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),  # shorthand \fracab -> \frac{a}{b}
    ("Answer: 3\nchecking again...\nAnswer: 7", "7", 1.0, "7"),  # the last one counts
    ("Answer: 7" + "." * 300, "7", -1.0, "[INVALID]"),  # only the last 300 characters are searched
    ("Answer: 0.5", "\\frac{1}{2}", -1.0, "0.5"),  # strings, not values: DAPO does not verify equivalence
]


@pytest.mark.parametrize("response, gold, score, pred", CASES)
def test_dapo_scores_plus_one_or_minus_one(response, gold, score, pred):
    assert get_reward_fn("dapo")(response, gold) == {"score": score, "acc": float(score > 0), "pred": pred}
    assert get_reward_fn("dapo_accuracy")(response, gold) == {"score": float(score > 0), "pred": pred}
    assert get_answer_extractor("dapo")(response) == (None if pred == "[INVALID]" else pred)


def test_gold_answers_normalize_like_responses():
    assert normalize_answer("\\$1,000") == normalize_answer("1000") == "1000"
    assert normalize_answer("1,000.") == "1,000."  # a trailing period blocks the number rule, as in Minerva
    assert normalize_answer("\\text{(B)}") == "(B)"


def _dapo_rows():
    """Two problems of DAPO-Math-17K as published (columns, nesting, repeated rows)."""
    def row(index, problem, gold):
        text = prepare.DAPO_TEMPLATE.format(problem=problem)
        return {"data_source": "math_dapo", "prompt": [{"content": text, "role": "user"}], "ability": "MATH",
                "reward_model": {"ground_truth": gold, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": index}}
    return [row("a", "What is 2+2?", "4"), row("a", "What is 2+2?", "4"), row("b", "What is 6*7?", "42")]


def test_the_recipe_reads_what_prepare_writes_and_scores_it_with_dapo(tmp_path):
    src = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(_dapo_rows()), src)
    for variant in ("bf16", "fp8", "fp8_calibrated"):
        cfg = load_config(ROOT / "examples/qwen3_14b_dapo" / f"{variant}.yaml")
        assert (cfg.reward.name, Path(cfg.data.path).suffix) == ("dapo", ".jsonl")
        assert {d.reward for d in cfg.eval.datasets} == {"dapo_accuracy"}
    out = tmp_path / cfg.data.path
    assert prepare.main(["dapo", str(src), str(out)]) == 0
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    data = load_config(ROOT / "examples/qwen3_14b_dapo/bf16.yaml", [f"data.path={out}"]).data
    items = list(build_dataset(data, tok, seed=0))
    assert [(it.answer, it.extra["data_source"]) for it in items] == [("4", "math_dapo"), ("42", "math_dapo")]
    assert all(it.prompt_text.startswith("Solve the following math problem") for it in items)
    reward = get_reward_fn(cfg.reward.name)
    assert [reward(r, it.answer)["score"] for r, it in zip(["...\nAnswer: 4", "Answer: 41"], items)] == [1.0, -1.0]


def test_an_aime_file_prepared_in_dapo_style_is_what_the_recipes_eval_reads(tmp_path):
    src = tmp_path / "aime_2024.parquet"
    pq.write_table(pa.Table.from_pylist([{"ID": "2024-I-1", "Problem": "Find n.", "Answer": 204}]), src)
    cfg = load_config(ROOT / "examples/qwen3_14b_dapo/bf16.yaml")
    aime = next(d for d in cfg.eval.datasets if d.name == "aime24")
    out = tmp_path / aime.path
    assert prepare.main(["aime", str(src), str(out), "--style", "dapo"]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["prompt"] == prepare.DAPO_TEMPLATE.format(problem="Find n.") and row["answer"] == "204"
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (item,) = list(read_prompts(cfg.data, tok, str(out)))
    assert get_reward_fn(aime.reward)("so n = 204.\nAnswer: 204", item.answer)["score"] == 1.0
    with pytest.raises(ValueError, match="style 'latex'"):
        prepare.convert("aime", src, out, style="latex")
