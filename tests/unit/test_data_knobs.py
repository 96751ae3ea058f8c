"""The data.* knobs through the one dataset builder (loop/build.py::build_dataset): chat template
on/off, system prompt, template kwargs, prompt template, dotted keys, any-type answers, extras,
shuffle and epochs, and error messages naming the missing key."""

import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import load_config
from megatron_rl.data import PromptLoader, build_char_tokenizer
from megatron_rl.loop.build import build_data, build_dataset

# Hand-written char ids (see test_data_tasks.py): digits 4..13, 'a'..'z' 14..39, ':'=40 '='=41 '+'=42 ','=44.
CHAR_ID = {**{str(d): 4 + d for d in range(10)}, **{chr(97 + i): 14 + i for i in range(26)}, ":": 40, "=": 41, "+": 42, ",": 44}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }},{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}{% if enable_thinking is defined and not enable_thinking %}n:{% endif %}"
)


def _ids(text):
    return [CHAR_ID[c] for c in text]


@pytest.fixture()
def tok():
    t = build_char_tokenizer()
    t.chat_template = TEMPLATE
    return t


def _data(tmp_path, rows, *overrides, name="d.jsonl"):
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return load_config(None, [f"data.path={path}", *overrides]).data


def test_system_prompt_and_template_kwargs_in_the_tokenized_prompt(tmp_path, tok):
    rows = [{"prompt": "sort:21=", "answer": "12"},
            {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "rev:9="}], "answer": "9"}]
    ds = build_dataset(_data(tmp_path, rows, "data.system_prompt=be"), tok, seed=0)
    assert ds[0].prompt_ids == [1] + _ids("s:be,u:sort:21=,a:")
    assert ds[1].prompt_ids == [1] + _ids("s:own,u:rev:9=,a:")  # its own system message wins
    ds = build_dataset(_data(tmp_path, rows[:1], "data.template_kwargs={enable_thinking: false}"), tok, seed=0)
    assert ds[0].prompt_ids == [1] + _ids("u:sort:21=,a:n:")


def test_prompt_template_with_and_without_chat_template(tmp_path, tok):
    rows = [{"prompt": "sort:21=", "answer": "12"}]
    plain = build_dataset(_data(tmp_path, rows, "data.chat_template=false", "data.prompt_template='q:{prompt}a:'"),
                          tok, seed=0)
    assert plain[0].prompt_text == "q:sort:21=a:" and plain[0].prompt_ids == [1] + _ids("q:sort:21=a:")
    chat = build_dataset(_data(tmp_path, rows, "data.prompt_template='q:{prompt}'"), tok, seed=0)
    assert chat[0].prompt_ids == [1] + _ids("u:q:sort:21=,a:")
    sys_plain = build_dataset(_data(tmp_path, rows, "data.chat_template=false", "data.system_prompt=be"), tok, seed=0)
    assert sys_plain[0].prompt_text == "be\nsort:21="


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_nested_keys_integer_answers_and_extras(tmp_path, tok, name):
    rows = [{"data_source": "dapo", "prompt": "add:1+2=", "reward_model": {"ground_truth": 3, "style": "rule"}},
            {"data_source": "dapo", "prompt": "add:2+2=", "reward_model": {"ground_truth": 4, "style": "rule"}}]
    d = _data(tmp_path, rows, "data.answer_key=reward_model.ground_truth", "data.chat_template=false", name=name)
    ds = build_dataset(d, tok, seed=0)
    assert [it.answer for it in ds] == ["3", "4"]
    assert ds[0].extra == {"data_source": "dapo", "reward_model": {"ground_truth": 3, "style": "rule"}}


def test_any_json_answer_is_stringified(tmp_path, tok):
    rows = [{"prompt": "a", "answer": 7}, {"prompt": "b", "answer": 0.5}, {"prompt": "c", "answer": [1, 2]},
            {"prompt": "d", "answer": True}]
    ds = build_dataset(_data(tmp_path, rows, "data.chat_template=false"), tok, seed=0)
    assert [it.answer for it in ds] == ["7", "0.5", "[1, 2]", "true"]


def test_missing_answer_column_is_named(tmp_path, tok):
    rows = [{"question": "sort:21=", "solution": "12"}] * 2
    with pytest.raises(ValueError, match="rows missing key: {'answer': 2}"):
        build_dataset(_data(tmp_path, rows, "data.prompt_key=question", "data.chat_template=false"), tok, seed=0)
    with pytest.raises(ValueError, match="no column 'answer'"):
        build_dataset(_data(tmp_path, rows, "data.prompt_key=question", name="d.parquet"), tok, seed=0)
    with pytest.raises(ValueError, match="config key 'data.path': no such file"):
        build_dataset(load_config(None, [f"data.path={tmp_path}/none.jsonl"]).data, tok, seed=0)


def test_epochs_cap_the_run_and_shuffle_off_keeps_the_order(tmp_path, tok):
    rows = [{"prompt": f"rev:{i}=", "answer": str(i)} for i in range(10)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(None, [f"data.path={path}", "data.num_epochs=2", "data.shuffle=false",
                             "data.prompts_per_step=4", "data.chat_template=false", "train.num_steps=40"])
    loader = build_data(cfg, tok, SimpleNamespace(dp_size=1))
    assert cfg.train.num_steps == 5 and loader.num_batches == 5  # 2 x 10 prompts / 4, the rest dropped
    seen = [int(it.answer) for _ in range(5) for it in loader.next_batch()]
    assert seen == list(range(10)) + list(range(10))
    with pytest.raises(StopIteration):
        loader.next_batch()
    shuffled = PromptLoader(loader.dataset, batch_size=5, seed=3, num_epochs=1)
    assert sorted(it.index for b in shuffled for it in b) == list(range(10))


def test_bad_data_knobs_name_the_key():
    for override, key in (("data.num_epochs=-1", "data.num_epochs"), ("data.prompt_template=x", "data.prompt_template"),
                          ("data.template_kwargs=[1]", "data.template_kwargs")):
        with pytest.raises(ValueError, match=f"config key '{key}'"):
            load_config(None, [override])
    with pytest.raises(ValueError, match="config key 'data.template_kwargs'"):
        load_config(None, ["data.chat_template=false", "data.template_kwargs={enable_thinking: false}"])
