"""examples/data/prepare.py on small fixtures with the published columns of DeepScaleR, DAPO-Math-17K
and AIME; the output loads through the training data path with the intended keys."""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_rl.config import load_config
from megatron_rl.data import build_char_tokenizer
from megatron_rl.loop.build import build_dataset

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "examples/data/prepare.py")
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)


def _lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_deepscaler_json(tmp_path):
    src = tmp_path / "deepscaler.json"
    src.write_text(json.dumps([{"problem": "What is 1+1?", "answer": "2", "solution": "1+1=2"},
                               {"problem": "No answer", "answer": None, "solution": ""}]))
    counts = prepare.convert("deepscaler", src, tmp_path / "out.jsonl")
    assert counts == {"written": 1, "dropped": 1}
    assert _lines(tmp_path / "out.jsonl") == [{"prompt": "What is 1+1? " + prepare.INSTRUCTION, "answer": "2",
                                              "data_source": "deepscaler"}]


def test_dapo_parquet_nested_and_deduplicated(tmp_path):
    row = {"data_source": "math_dapo", "prompt": [{"content": "Solve 2x=4. Answer: $Answer", "role": "user"}],
           "ability": "MATH", "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
           "extra_info": {"index": "a1"}}
    other = {**row, "prompt": [{"content": "Solve x=3.", "role": "user"}],
             "reward_model": {"ground_truth": "3", "style": "rule"}, "extra_info": {"index": "b2"}}
    src = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist([row, row, other, row]), src)
    assert prepare.main(["dapo", str(src), str(tmp_path / "dapo.jsonl")]) == 0
    assert _lines(tmp_path / "dapo.jsonl") == [
        {"prompt": "Solve 2x=4. Answer: $Answer", "answer": "2", "data_source": "math_dapo", "index": "a1"},
        {"prompt": "Solve x=3.", "answer": "3", "data_source": "math_dapo", "index": "b2"}]
    # The published file also trains directly: the nested key and the message list, with a chat template.
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    raw = build_dataset(load_config(None, [f"data.path={src}", "data.answer_key=reward_model.ground_truth",
                                           "data.max_prompt_len=64"]).data, tok, seed=0)
    assert [it.answer for it in raw] == ["2", "2", "3", "2"] and raw[0].extra["extra_info"] == {"index": "a1"}


def test_aime_capitalized_integer_answers(tmp_path):
    src = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist([{"ID": "2024-I-1", "Problem": "Find n.", "Solution": "...", "Answer": 204}]), src)
    prepare.convert("aime", src, tmp_path / "aime.jsonl")
    assert _lines(tmp_path / "aime.jsonl") == [{"prompt": "Find n. " + prepare.INSTRUCTION, "answer": "204",
                                               "data_source": "aime", "id": "2024-I-1"}]
