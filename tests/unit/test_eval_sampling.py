"""Evaluation samples and scores through the rollout path (loop/sampling.py): every rollout sampling
knob with the dataset's overrides reaches the engine, the reward sees the row's columns, the prompt
and the text before a stop string, and reward errors and timeouts are counted in the metrics and
eval_results. The engine is a recorder (what the engine does with the knobs is
test_rollout_sampling_knobs.py's); the reward runs in the real worker pool."""

import json
from types import SimpleNamespace

import pytest

from megatron_rl.config import load_config
from megatron_rl.data import build_char_tokenizer
from megatron_rl.data.datasets import PromptItem
from megatron_rl.loop.evaluate import EvalSet, Evaluator
from megatron_rl.rollout.base import Sample

REWARDS = '''
import time


def judge(response, answer, data_source, prompt):
    """1 for the right answer from a 'good' source; the pred carries what the reward saw."""
    if data_source == "boom":
        raise RuntimeError("grader down")
    if data_source == "slow":
        time.sleep(30)
    return {"score": float(response == answer and data_source == "good"), "pred": response + "|" + prompt}


def legacy(response, answer):
    return float(response == answer)
'''


class Recorder:
    """An engine that returns fixed responses (text per prompt, the same for its n samples)."""

    def __init__(self, tokenizer, responses):
        self.tokenizer, self.responses, self.calls = tokenizer, responses, []

    def generate(self, prompts, sampling):
        self.calls.append(sampling)
        ids = [self.tokenizer.encode(r, add_special_tokens=False) for r in self.responses]
        return [Sample(i, list(p), ids[i], [0.0] * len(ids[i]), "stop")
                for i, p in enumerate(prompts) for _ in range(sampling.n)]


def _evaluator(tmp_path, overrides, datasets, responses, rows):
    (tmp_path / "rewards_eval.py").write_text(REWARDS)
    cfg = load_config(None, [*overrides, "eval.datasets=" + json.dumps(datasets)])
    tok = build_char_tokenizer()
    parallel = SimpleNamespace(dp_rank=0, dp_size=1, tp_size=1, pp_size=1, dp_group=None,
                               dp_reducer=lambda: (lambda t: t))
    run = SimpleNamespace(cfg=cfg, tokenizer=tok, engine=Recorder(tok, responses), parallel=parallel,
                          is_engine_rank=True, host_groups=None)
    prompts = [PromptItem(tok.encode(f"q{i}"), f"<q{i}>", answer, i, extra)
               for i, (answer, extra) in enumerate(rows)]
    sets = [EvalSet(d, prompts, d.reward, None, None, list(d.metrics)) for d in cfg.eval.datasets]
    return Evaluator(run, sets)


def test_every_rollout_knob_and_the_datasets_overrides_reach_the_engine(tmp_path):
    rollout = ["rollout.top_k=20", "rollout.min_p=0.05", "rollout.stop=['</a>']", "rollout.stop_token_ids=[7]",
               "rollout.repetition_penalty=1.1", "rollout.max_new_tokens=9", "rollout.temperature=0.7"]
    plain = {"name": "plain", "path": "x.jsonl", "n_samples": 2, "metrics": ["avg@2"], "temperature": 0.6,
             "reward": "exact_match"}
    own = {**plain, "name": "own", "top_k": 5, "min_p": 0.0, "stop": ["#"], "stop_token_ids": [],
           "repetition_penalty": 1.0, "max_new_tokens": 3, "top_p": 0.9}
    ev = _evaluator(tmp_path, rollout, [plain, own], ["a", "b"], [("a", {}), ("b", {})])
    try:
        ev.evaluate(step=0)
    finally:
        ev.close()
    first, second = ev.run.engine.calls
    eos = ev.run.tokenizer.eos_token_id
    assert (first.temperature, first.top_p, first.max_new_tokens, first.top_k, first.min_p, tuple(first.stop),
            list(first.stop_token_ids), first.repetition_penalty, first.n) == (
        0.6, 1.0, 9, 20, 0.05, ("</a>",), [eos, 7], 1.1, 2)  # the dataset's temperature, the rollout's rest
    assert (second.temperature, second.top_p, second.max_new_tokens, second.top_k, second.min_p,
            tuple(second.stop), list(second.stop_token_ids), second.repetition_penalty) == (
        0.6, 0.9, 3, 5, 0.0, ("#",), [eos], 1.0)


def test_the_reward_sees_the_rows_columns_the_prompt_and_the_text_before_a_stop(tmp_path):
    judge = f"{tmp_path / 'rewards_eval.py'}:judge"
    data = {"name": "h", "path": "x.jsonl", "n_samples": 2, "metrics": ["avg@2", "pass@2"], "reward": judge,
            "stop": ["x"]}
    rows = [("12", {"data_source": "good"}), ("34", {"data_source": "other"}), ("56", {"data_source": "good"})]
    ev = _evaluator(tmp_path, [], [data], ["12x9", "34", "57"], rows)
    try:
        metrics = ev.evaluate(step=0)
    finally:
        ev.close()
    # problem 0: right and good (1, 1); problem 1: right, other source (0, 0); problem 2: wrong (0, 0)
    assert metrics["eval/h/avg@2"] == pytest.approx(1 / 3) and metrics["eval/h/pass@2"] == pytest.approx(1 / 3)
    assert (metrics["eval/h/reward_errors"], metrics["eval/h/reward_timeouts"]) == (0.0, 0.0)
    rows_seen = ev._generate_and_score(ev.run.engine, ev.sets[0], ev.sets[0].prompts, seed=0)[0]
    assert [r["preds"] for r in rows_seen] == [["12|<q0>"] * 2, ["34|<q1>"] * 2, ["57|<q2>"] * 2]


def test_reward_errors_and_timeouts_are_counted_in_the_metrics_and_the_results(tmp_path):
    judge = f"{tmp_path / 'rewards_eval.py'}:judge"
    data = {"name": "h", "path": "x.jsonl", "n_samples": 2, "metrics": ["avg@2"], "reward": judge}
    rows = [("1", {"data_source": "boom"}), ("2", {"data_source": "good"}), ("3", {"data_source": "slow"})]
    ev = _evaluator(tmp_path, ["reward.timeout_s=1.0", "reward.num_workers=2"], [data], ["1", "2", "3"], rows)
    try:
        metrics = ev.evaluate(step=0)
    finally:
        ev.close()
    assert (metrics["eval/h/reward_errors"], metrics["eval/h/reward_timeouts"]) == (2.0, 2.0)
    assert metrics["eval/h/avg@2"] == pytest.approx(1 / 3)
    assert ev.results["h"]["metrics"]["reward_errors"] == 2.0 and ev.results["h"]["metrics"]["reward_timeouts"] == 2.0


def test_a_reward_without_extra_arguments_still_works(tmp_path):
    legacy = f"{tmp_path / 'rewards_eval.py'}:legacy"
    data = {"name": "h", "path": "x.jsonl", "n_samples": 1, "metrics": ["avg@1"], "reward": legacy}
    ev = _evaluator(tmp_path, [], [data], ["1", "0"], [("1", {"data_source": "x"}), ("2", {})])
    try:
        assert ev.evaluate(step=0)["eval/h/avg@1"] == 0.5
    finally:
        ev.close()


def test_an_eval_file_with_a_dotted_answer_key_is_read_as_the_training_data(tmp_path):
    """data.answer_key=reward_model.ground_truth (verl's layout) on an eval file: the check at start
    accepts the nested column, the answers are the nested values, the other columns ride along."""
    from megatron_rl.loop.evaluate import build_eval_sets

    rows = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}, "data_source": "easy"},
            {"prompt": "2+3=", "reward_model": {"ground_truth": 5}, "data_source": "hard"}]
    path = tmp_path / "nested.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"name": "h", "path": str(path), "n_samples": 1, "metrics": ["avg@1"], "reward": "exact_match"}
    cfg = load_config(None, ["data.answer_key=reward_model.ground_truth", "eval.datasets=" + json.dumps([data])])
    (s,) = build_eval_sets(cfg, build_char_tokenizer())
    assert [(p.answer, p.extra["data_source"]) for p in s.prompts] == [("2", "easy"), ("5", "hard")]
    cfg = load_config(None, ["data.answer_key=reward_model.truth", "eval.datasets=" + json.dumps([data])])
    with pytest.raises(ValueError, match=r"has no data.answer_key column 'reward_model.truth'"):
        build_eval_sets(cfg, build_char_tokenizer())  # the top column exists, the nested key does not


def test_bad_dataset_sampling_overrides_name_the_key():
    base = {"name": "h", "task": "sort"}
    for field, value, message in (("top_k", 0, "must be -1 \\(off\\) or >= 1"), ("min_p", 1.5, "must be in \\[0, 1\\]"),
                                  ("stop", [""], "empty stop string"), ("stop_token_ids", [-2], "negative id"),
                                  ("repetition_penalty", 0.0, "must be in \\(0, 2\\]")):
        with pytest.raises(ValueError, match=f"config key 'eval.datasets\\[0\\].{field}': {message}"):
            load_config(None, ["eval.datasets=" + json.dumps([{**base, field: value}])])
    with pytest.raises(ValueError, match="config key 'eval.datasets\\[0\\].top_k': expected int"):
        load_config(None, ["eval.datasets=" + json.dumps([{**base, "top_k": "many"}])])
    unset = load_config(None, ["eval.datasets=" + json.dumps([base])]).eval.datasets[0]
    assert (unset.top_k, unset.min_p, unset.stop, unset.stop_token_ids, unset.repetition_penalty) == (None,) * 5
    seeded = ["rollout.engine=sglang", "rollout.sglang.deterministic_inference=true"]
    with pytest.raises(ValueError, match="config key 'eval.datasets\\[0\\].min_p': SGLang's seeded"):
        load_config(None, [*seeded, "eval.datasets=" + json.dumps([{**base, "min_p": 0.1}])])
    load_config(None, [*seeded, "eval.datasets=" + json.dumps([base])])  # unset: the rollout's 0
