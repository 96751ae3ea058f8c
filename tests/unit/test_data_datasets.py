"""Prompt datasets: bad rows skipped and counted with the reason and location, chat template, loader resume."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data import PromptDataset, PromptLoader, build_char_tokenizer

# Hand-written char ids (see test_data_tasks.py): digits 4..13, 'a'..'z' 14..39, ':'=40 '='=41 '+'=42 ','=44.
CHAR_ID = {**{str(d): 4 + d for d in range(10)}, **{chr(97 + i): 14 + i for i in range(26)}, ":": 40, "=": 41, "+": 42, ",": 44}


def _ids(text):
    return [CHAR_ID[c] for c in text]


@pytest.fixture()
def tok():
    return build_char_tokenizer()


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_bad_rows_skipped_and_counted(tmp_path, tok, caplog):
    lines = [
        json.dumps({"prompt": "sort:21=", "answer": "12"}),  # line 1: good
        '{"prompt": "sort:1=", "answer": ',  # line 2: unparsable
        json.dumps({"prompt": "rev:12="}),  # line 3: missing answer
        json.dumps({"prompt": 123, "answer": "1"}),  # line 4: non-string prompt
        json.dumps({"prompt": "   ", "answer": "1"}),  # line 5: empty prompt
        json.dumps({"prompt": "sort:" + "1" * 30 + "=", "answer": "1"}),  # line 6: 37 tokens > 16
        json.dumps([1, 2]),  # line 7: not an object
        "",  # line 8: blank, ignored silently
        json.dumps({"prompt": "rev:34=", "answer": "43", "extra": 1}),  # line 9: good
        json.dumps({"prompt": "rev:3=", "answer": ["3"]}),  # line 10: a list answer, kept as JSON text
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.datasets"):
        ds = PromptDataset.from_jsonl(path, tok, max_prompt_len=16)
    assert len(ds) == 3 and ds.num_skipped == 6
    assert ds.skip_reasons == {
        "bad_json": 1, "missing_field": 1, "not_string": 1, "empty": 1, "too_long": 1, "not_object": 1,
    }
    assert [(it.prompt_text, it.answer, it.index) for it in ds] == [
        ("sort:21=", "12", 0), ("rev:34=", "43", 1), ("rev:3=", '["3"]', 2)]
    assert ds[1].extra == {"extra": 1} and ds[0].extra == {}
    assert ds[0].prompt_ids == [1] + _ids("sort:21=")
    text = caplog.text
    for line_no, reason in [(2, "bad_json"), (3, "missing_field"), (4, "not_string"), (5, "empty"), (6, "too_long"), (7, "not_object")]:
        assert f"{path}:{line_no}: skipped bad row ({reason})" in text
    assert f"{path}:8" not in text and f"{path}:1:" not in text


def test_custom_keys_and_no_answer(tmp_path, tok):
    path = _write_jsonl(tmp_path / "k.jsonl", [json.dumps({"question": "add:12+30=", "solution": "42"})])
    ds = PromptDataset.from_jsonl(path, tok, prompt_key="question", answer_key="solution")
    assert ds[0].answer == "42" and ds[0].prompt_ids == [1, 14, 17, 17, 40, 5, 6, 42, 7, 4, 41]
    no_answer = PromptDataset.from_records([{"question": "rev:1="}], tok, prompt_key="question", answer_key=None)
    assert no_answer[0].answer == ""


def test_all_rows_bad_raises(tmp_path, tok):
    path = _write_jsonl(tmp_path / "bad.jsonl", ["nope", json.dumps({"answer": "1"})])
    with pytest.raises(ValueError, match=r"no valid rows .*'bad_json': 1.*'missing_field': 1"):
        PromptDataset.from_jsonl(path, tok)


def test_unknown_option_and_bad_max_len(tmp_path, tok):
    path = _write_jsonl(tmp_path / "ok.jsonl", [json.dumps({"prompt": "a", "answer": "b"})])
    with pytest.raises(ValueError, match="promt_key"):
        PromptDataset.from_jsonl(path, tok, promt_key="prompt")
    with pytest.raises(ValueError, match="max_prompt_len"):
        PromptDataset.from_jsonl(path, tok, max_prompt_len=0)


def test_parquet_rows(tmp_path, tok, caplog):
    table = pa.table({
        "prompt": ["rev:12=", None, "sort:" + "9" * 40 + "=", "sort:31="],
        "answer": ["21", "1", "9", "13"],
        "other": [1, 2, 3, 4],
    })
    path = str(tmp_path / "d.parquet")
    pq.write_table(table, path)
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset.from_parquet(path, tok, max_prompt_len=20)
    assert [it.answer for it in ds] == ["21", "13"]
    assert ds.skip_reasons == {"missing_field": 1, "too_long": 1}
    assert f"{path} row 1: skipped bad row (missing_field)" in caplog.text
    assert f"{path} row 2: skipped bad row (too_long)" in caplog.text
    with pytest.raises(ValueError, match="no column 'question'"):
        PromptDataset.from_parquet(path, tok, prompt_key="question")


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }},{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def test_chat_template_applied(tok):
    tok.chat_template = TEMPLATE
    records = [
        {"prompt": "sort:21=", "answer": "12"},
        {"prompt": [{"role": "system", "content": "be"}, {"role": "user", "content": "rev:9="}], "answer": "9"},
    ]
    ds = PromptDataset.from_records(records, tok)
    assert ds[0].prompt_text == "<s>u:sort:21=,a:"
    assert ds[0].prompt_ids == [1] + _ids("u:sort:21=,a:")  # bos once: the template writes it
    assert ds[1].prompt_ids == [1] + _ids("s:be,u:rev:9=,a:")
    plain = PromptDataset.from_records(records[:1], tok, apply_chat_template=False)
    assert plain[0].prompt_ids == [1] + _ids("sort:21=")


def test_message_list_without_template_is_bad_row(tok):
    records = [{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}, {"prompt": "ok", "answer": "1"}]
    ds = PromptDataset.from_records(records, tok)
    assert len(ds) == 1 and ds.skip_reasons == {"not_string": 1}
    with pytest.raises(ValueError, match="no chat_template"):
        PromptDataset.from_records(records, tok, apply_chat_template=True)


def _dataset(tok, n):
    return PromptDataset.from_records([{"prompt": f"rev:{i}=", "answer": str(i)} for i in range(n)], tok)


def test_loader_epochs_are_permutations(tok):
    loader = PromptLoader(_dataset(tok, 5), batch_size=5, seed=7)
    epochs = [[it.index for it in loader.next_batch()] for _ in range(4)]
    assert all(sorted(e) == [0, 1, 2, 3, 4] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    other = PromptLoader(_dataset(tok, 5), batch_size=5, seed=8)
    assert [[it.index for it in other.next_batch()] for _ in range(4)] != epochs
    ordered = PromptLoader(_dataset(tok, 5), batch_size=3, seed=7, shuffle=False)
    assert [[it.index for it in ordered.next_batch()] for _ in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


def test_loader_resume_gives_identical_sequence(tok):
    ds = _dataset(tok, 5)
    full = PromptLoader(ds, batch_size=3, seed=11)
    reference = [[it.index for it in full.next_batch()] for _ in range(9)]
    first = PromptLoader(ds, batch_size=3, seed=11)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip
    resumed = PromptLoader(ds, batch_size=3, seed=999)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert [[it.index for it in resumed.next_batch()] for _ in range(5)] == reference[4:]
    with pytest.raises(ValueError, match="num_items"):
        PromptLoader(_dataset(tok, 6), batch_size=3, seed=11).load_state_dict(state)
