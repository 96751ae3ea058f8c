"""Every input is checked before anything is built (loop/preflight.py): data and eval files, their
columns (dotted ones too), the chat template, the tokenizer, eval tasks and rewards; one error
naming the config key. train.run is called with build_run replaced by a tripwire."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl import train
from megatron_rl.config import load_config
from megatron_rl.data.char_tokenizer import build_char_tokenizer
from megatron_rl.loop import build
from megatron_rl.loop.evaluate import build_eval_sets

ROOT = Path(__file__).resolve().parents[2]


class Built(Exception):
    """build_run was reached: every check had passed."""


@pytest.fixture
def run_until_build(monkeypatch, tmp_path):
    def tripwire(cfg):
        raise Built()

    monkeypatch.setattr(build, "build_run", tripwire)

    def run(*overrides: str) -> None:
        train.run(load_config(None, [f"log.dir={tmp_path / 'run'}", *overrides]))

    return run


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


NESTED = [{"prompt": "sort:31=", "reward_model": {"ground_truth": "13", "style": "rule"}},
          {"prompt": "sort:52=", "reward_model": {"ground_truth": "25", "style": "rule"}}]


def _refused(run, match: str, *overrides: str) -> None:
    with pytest.raises(ValueError, match=match):
        run(*overrides)


def test_data_files_are_checked_before_the_build(run_until_build, tmp_path):
    _refused(run_until_build, r"config key 'data.path': no such file .*nowhere.jsonl", f"data.path={tmp_path}/nowhere.jsonl")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    _refused(run_until_build, r"config key 'data.path': .*blank.jsonl has no rows", f"data.path={blank}")
    rows = _jsonl(tmp_path / "rows.jsonl", NESTED)
    _refused(run_until_build, r"'data.path': .*has no data.answer_key column 'answer' \(its first row has keys: "
             r"\['prompt', 'reward_model'\]\)", f"data.path={rows}")
    _refused(run_until_build, r"'data.path': .*no data.answer_key column 'reward_model.answer'",
             f"data.path={rows}", "data.answer_key=reward_model.answer")
    with pytest.raises(Built):  # a dotted key into the nested column passes
        run_until_build(f"data.path={rows}", "data.answer_key=reward_model.ground_truth")


def test_parquet_columns_are_followed_into_structs(run_until_build, tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(NESTED), path)
    _refused(run_until_build, r"'data.path': .*no data.answer_key column 'reward_model.answer' \(its columns: "
             r"\['prompt', 'reward_model'\]\)", f"data.path={path}", "data.answer_key=reward_model.answer")
    with pytest.raises(Built):
        run_until_build(f"data.path={path}", "data.answer_key=reward_model.ground_truth")
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    _refused(run_until_build, r"'data.path': .*empty.parquet has no rows", f"data.path={empty}")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_eval_files_take_dotted_answer_keys(tmp_path, suffix):
    path = tmp_path / f"eval{suffix}"
    if suffix == ".jsonl":
        _jsonl(path, NESTED)
    else:
        pq.write_table(pa.Table.from_pylist(NESTED), path)
    cfg = load_config(None, ["data.answer_key=reward_model.ground_truth",
                             "eval.datasets=" + json.dumps([{"name": "h", "path": str(path)}])])
    (evalset,) = build_eval_sets(cfg, build_char_tokenizer())
    assert [p.answer for p in evalset.prompts] == ["13", "25"]


def test_eval_inputs_are_checked_before_the_build(run_until_build, tmp_path):
    rows = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "sort:31=", "answer": "13"}])
    ds = lambda **kw: "eval.datasets=" + json.dumps([{"name": "ok", "task": "sort"}, {"name": "h", **kw}])  # noqa: E731
    _refused(run_until_build, r"config key 'eval.datasets\[1\].path': no such file", ds(path=f"{tmp_path}/no.jsonl"))
    _refused(run_until_build, r"config key 'eval.datasets\[1\].reward': unknown reward function 'nope'",
             ds(path=str(rows), reward="nope"))
    _refused(run_until_build, r"config key 'eval.datasets\[1\].task': unknown task 'sorting'", ds(task="sorting"))
    questions = _jsonl(tmp_path / "questions.jsonl", [{"question": "sort:31=", "answer": "13"}])
    _refused(run_until_build, r"config key 'eval.datasets\[1\].path': .*no data.prompt_key column 'question'",
             ds(path=str(rows)), "data.prompt_key=question", f"data.path={questions}")


def _hf_folder(path: Path, template: str | None) -> Path:
    """An HF folder as the preflight reads it: config.json and a (character) tokenizer."""
    tokenizer = build_char_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text("{}")
    return path


def test_a_chat_template_asked_for_must_exist(run_until_build, tmp_path):
    _refused(run_until_build, r"config key 'data.chat_template': true, but the built-in tiny model's character "
             r"tokenizer has no chat template", "data.chat_template=true")
    plain = _hf_folder(tmp_path / "plain", None)
    _refused(run_until_build, r"config key 'data.chat_template': true, but the tokenizer in .*plain has no chat "
             r"template", f"model.hf_dir={plain}", "data.chat_template=true")
    with pytest.raises(Built):  # without asking for one, the plain tokenizer is fine
        run_until_build(f"model.hf_dir={plain}")
    chat = _hf_folder(tmp_path / "chat", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(Built):
        run_until_build(f"model.hf_dir={chat}", "data.chat_template=true")


def test_megatron_rl_eval_checks_its_files_before_the_build(run_until_build, tmp_path, capsys):
    from megatron_rl.cli import main

    ds = "eval.datasets=" + json.dumps([{"name": "h", "path": f"{tmp_path}/aime.jsonl"}])
    assert main(["eval", str(ROOT / "examples/tiny/bf16.yaml"), ds, f"log.dir={tmp_path}/run"]) == 2
    assert f"config key 'eval.datasets[0].path': no such file {tmp_path}/aime.jsonl" in capsys.readouterr().err


def test_a_model_folder_without_a_loadable_tokenizer_is_refused(run_until_build, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _refused(run_until_build, r"config key 'model.hf_dir': no tokenizer in", f"model.hf_dir={folder}")
    _hf_folder(folder, None)
    (folder / "tokenizer.json").write_text("{not json")
    _refused(run_until_build, r"config key 'model.hf_dir': its tokenizer does not load", f"model.hf_dir={folder}")
    _refused(run_until_build, r"config key 'model.megatron_ckpt': no such folder",
             f"model.megatron_ckpt={tmp_path}/mcore")


def test_the_default_prompt_length_keeps_real_prompts(tmp_path):
    """A 300-token prompt (a competition problem with its instruction is 100-500 tokens) is kept by
    the default data.max_prompt_len; at 64 every row was dropped."""
    prompt = ("sort: " + "3, 1, 2, " * 33)[:300]
    path = _jsonl(tmp_path / "long.jsonl", [{"prompt": prompt, "answer": "1"}, {"prompt": prompt[:100], "answer": "2"}])
    cfg = load_config(None, [f"data.path={path}", "data.chat_template=false"])
    dataset = build.build_dataset(cfg.data, build_char_tokenizer(), seed=0)
    assert [len(item.prompt_ids) for item in dataset] == [301, 101]  # bos + one token per character


def test_the_cli_names_a_missing_file_in_one_line(tmp_path):
    """A real `megatron-rl train` process: exit 2, one error line, no traceback, no file written."""
    log_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "examples/tiny/bf16.yaml"),
                           f"data.path={tmp_path}/missing.jsonl", f"log.dir={log_dir}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"megatron-rl: error: config key 'data.path': no such file {tmp_path}/missing.jsonl" in proc.stderr
    assert not log_dir.exists()
