"""The eval section and checkpoint.keep_best: parsed as a list of sections, bad input refused at load naming the key."""

import json

import pytest

from megatron_rl.config import load_config, save_config


def _ds(**kw) -> str:
    return "eval.datasets=" + json.dumps([{"name": "h", **kw}])


def test_a_list_of_dataset_sections_parses_and_round_trips(tmp_path):
    cfg = load_config(None, [_ds(task="sort", n_samples=4, metrics=["avg@4", "pass@2", "maj@4"], temperature=1),
                             "eval.every=5", "eval.precision=both", "checkpoint.keep_best=h/pass@2"])
    d = cfg.eval.datasets[0]
    assert (d.name, d.task, d.n_samples, d.temperature) == ("h", "sort", 4, 1.0)
    assert d.metrics == ["avg@4", "pass@2", "maj@4"]
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").eval == cfg.eval


def _refused(match: str, *overrides: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(None, list(overrides))


def _refused_at_start(match: str, *overrides: str) -> None:
    """Eval files are read when the run starts (before the first step), not at config load."""
    from megatron_rl.data.char_tokenizer import build_char_tokenizer
    from megatron_rl.loop.evaluate import build_eval_sets

    cfg = load_config(None, list(overrides))
    with pytest.raises(ValueError, match=match):
        build_eval_sets(cfg, build_char_tokenizer())


def test_missing_eval_file():
    _refused_at_start(r"'eval.datasets\[0\].path': no such file", _ds(path="no/such/file.jsonl"))
    _refused(r"'eval.datasets\[0\].path'.*neither .jsonl nor .parquet", _ds(path="file.csv"))


def test_eval_file_without_the_answer_column(tmp_path):
    from megatron_rl.data.char_tokenizer import build_char_tokenizer
    from megatron_rl.loop.evaluate import build_eval_sets

    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps({"prompt": "sort:31=", "solution": "13"}) + "\n")
    _refused_at_start(r"'eval.datasets\[0\].path'.*no data.answer_key column 'answer'", _ds(path=str(path)))
    cfg = load_config(None, [_ds(path=str(path)), "data.answer_key=solution"])  # the training data's key decides
    assert [p.answer for p in build_eval_sets(cfg, build_char_tokenizer())[0].prompts] == ["13"]


def test_parquet_eval_file_without_the_answer_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": ["sort:31="]}), path)
    _refused_at_start(r"'eval.datasets\[0\].path'.*no data.answer_key column 'answer'", _ds(path=str(path)))


def test_k_above_n_samples_and_unknown_metric():
    _refused(r"'eval.datasets\[0\].metrics': 'pass@8' needs k=8 <= eval.datasets\[0\].n_samples=4",
             _ds(task="sort", n_samples=4, metrics=["pass@8"]))
    _refused(r"'eval.datasets\[0\].metrics': unknown metric 'mean@4'", _ds(task="sort", metrics=["mean@4"]))


@pytest.mark.parametrize("overrides, match", [
    ([_ds(task="sort", path="x.jsonl")], r"'eval.datasets\[0\].path': give exactly one"),
    ([_ds()], r"'eval.datasets\[0\].path': give exactly one"),
    (["eval.datasets=[{name: a/b, task: sort}]"], r"'eval.datasets\[0\].name'"),
    (["eval.datasets=[{name: a, task: sort}, {name: a, task: add}]"], r"'eval.datasets\[1\].name': 'a' is used twice"),
    ([_ds(task="sort", top_p=0)], r"'eval.datasets\[0\].top_p'"),
    ([_ds(task="sort", n_samples=0)], r"'eval.datasets\[0\].n_samples'"),
    ([_ds(task="sort", nsamples=2)], r"unknown config key 'eval.datasets\[0\].nsamples'"),
    (["eval.precision=fp8"], r"'eval.precision'"),
    (["eval.every=-1"], r"'eval.every'"),
    ([_ds(task="sort"), "checkpoint.keep_best=h/pass@4"], r"'checkpoint.keep_best'.*h/avg@1"),
    ([_ds(task="sort"), "checkpoint.keep_best=other/avg@1"], r"'checkpoint.keep_best'"),
    ([_ds(task="sort"), "checkpoint.keep_best=h/bf16/avg@1"], r"needs eval.precision bf16 or both"),
    ([_ds(task="sort"), "eval.precision=both", "rollout.engine=sglang", "precision.rollout_quant=fp8_blockwise"],
     r"'eval.precision'.*BF16"),
])
def test_bad_eval_input_names_the_key(overrides, match):
    _refused(match, *overrides)


def test_unknown_task_or_reward_is_refused_before_the_first_step():
    from megatron_rl.data.char_tokenizer import build_char_tokenizer
    from megatron_rl.loop.evaluate import build_eval_sets

    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"'eval.datasets\[0\].task': unknown task 'sortt'"):
        build_eval_sets(load_config(None, [_ds(task="sortt")]), tokenizer)
    with pytest.raises(ValueError, match=r"'eval.datasets\[0\].reward': unknown reward function 'nope'"):
        build_eval_sets(load_config(None, [_ds(task="sort", reward="nope")]), tokenizer)
