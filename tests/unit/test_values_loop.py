"""Value tests of loop/ decisions at their boundaries: the best checkpoint on a tie, refill's round
limit and padding, eval's schedule and its per-sample denominators, the sampling knobs and the
answer each response is scored against, the run folder's finished / empty-run boundaries, the
stop-request file, and preflight's key names. Expected values are by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.data.datasets import PromptItem
from megatron_rl.loop import refill, run_folder, signals
from megatron_rl.loop.best import BestCheckpoint
from megatron_rl.loop.evaluate import EvalSet, Evaluator, _reduce
from megatron_rl.loop.preflight import check_inputs
from megatron_rl.loop.sampling import sampling_params, score_texts


def test_an_equal_score_keeps_the_earlier_best(tmp_path):
    best = BestCheckpoint(tmp_path, "h/avg@4")
    best.scored(2, {"eval/h/avg@4": 0.5}, latest_step=2)
    best.scored(4, {"eval/h/avg@4": 0.5}, latest_step=4)  # a tie: the earlier checkpoint stays
    assert (tmp_path / "best").read_text() == "2"
    best.scored(6, {"eval/h/avg@4": 0.5000001}, latest_step=6)
    assert json.loads((tmp_path / "best.json").read_text())["step"] == 6


@pytest.mark.parametrize("limit, rounds, more", [(2, 1, True), (2, 2, False), (0, 50, True), (1, 1, False)])
def test_refill_stops_exactly_at_max_gen_batches(limit, rounds, more):
    algo = SimpleNamespace(dynamic_sampling=True, max_gen_batches=limit, on_max_gen_batches="train")
    counts = [torch.tensor([0, 1])] * rounds  # one kept group per round, target far away
    assert refill.needs_more(algo, 1000, counts, step=0) is more
    assert refill.needs_more(algo, rounds, counts, step=0) is False  # target reached exactly
    if not more and limit:
        with pytest.raises(RuntimeError, match="max_gen_batches"):
            refill.needs_more(SimpleNamespace(**{**vars(algo), "on_max_gen_batches": "fail"}), 1000, counts, 0)


def test_refill_pads_every_rank_to_the_most_any_rank_takes():
    counts = [torch.tensor([3, 1]), torch.tensor([2, 2])]
    # (round, rank) order up to 6: round 0 takes 3 + 1, round 1 takes 2 + 0.
    assert refill.plan(counts, 6, dp_rank=0) == ([3, 2], 5, 6)
    assert refill.plan(counts, 6, dp_rank=1) == ([1, 0], 5, 6)  # rank 1 trains 1 group, padded to 5
    assert refill.plan(counts, 100, dp_rank=1) == ([1, 2], 5, 8)


def test_eval_runs_at_step_zero_only_when_asked_and_then_every_n_steps():
    def due(every, at_start):
        run = SimpleNamespace(cfg=SimpleNamespace(eval=SimpleNamespace(every=every, at_start=at_start)))
        return [s for s in range(9) if Evaluator(run, []).due(s)]

    assert due(3, False) == [3, 6]
    assert due(3, True) == [0, 3, 6]
    assert due(1, False) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert due(0, True) == [0]


def test_eval_length_and_truncation_are_per_sample_and_scores_per_problem():
    run = SimpleNamespace(parallel=SimpleNamespace(dp_reducer=lambda: (lambda t: t), dp_group=None))
    s = EvalSet(SimpleNamespace(name="h"), [], "r", None, None, ["avg@2", "pass@2"])
    rows = [  # problem 1: 2 samples; problem 2: 4 samples (the denominators differ)
        {"rewards": [1.0, 0.0], "preds": [None, None], "lengths": [2, 4], "truncated": [False, True], "garbled": None},
        {"rewards": [0.0, 0.0, 0.0, 1.0], "preds": [None] * 4, "lengths": [6, 6, 6, 6],
         "truncated": [False] * 4, "garbled": None},
    ]
    out = _reduce(run, s, rows, [1, 2])
    assert out["avg@2"] == pytest.approx((0.5 + 0.25) / 2)
    assert out["pass@2"] == pytest.approx((1.0 + 0.5) / 2)  # 1 - C(3,2)/C(4,2) = 0.5
    assert out["response_length/mean"] == pytest.approx(30 / 6)
    assert out["response_length/max"] == 6.0
    assert out["truncated_rate"] == pytest.approx(1 / 6)
    assert (out["reward_errors"], out["reward_timeouts"]) == (1.0, 2.0)


def test_eos_stops_a_sample_beside_the_configured_stop_tokens():
    cfg = load_config(None, ["rollout.stop_token_ids=[7, 9]"]).rollout
    assert sampling_params(cfg, 2, n=1, seed=0).stop_token_ids == [2, 7, 9]
    assert sampling_params(load_config(None).rollout, 2, n=1, seed=0).stop_token_ids == [2]
    over = sampling_params(cfg, 2, n=3, seed=5, overrides={"temperature": 0.25, "top_p": None})
    assert (over.temperature, over.top_p, over.n, over.seed) == (0.25, cfg.top_p, 3, 5)


def test_each_response_is_scored_against_its_own_prompts_answer():
    class Runner:
        def score(self, texts, answers, extras):
            self.seen = list(zip(texts, answers, [e["prompt"] for e in extras]))
            return [0.0] * len(texts), {}

    prompts = [PromptItem([1], "<a>", "A", 0), PromptItem([2], "<b>", "B", 1)]
    runner = Runner()
    score_texts(runner, prompts, ["a0", "a1", "a2", "b0", "b1", "b2"], n=3)
    assert runner.seen == [("a0", "A", "<a>"), ("a1", "A", "<a>"), ("a2", "A", "<a>"),
                           ("b0", "B", "<b>"), ("b1", "B", "<b>"), ("b2", "B", "<b>")]


@pytest.mark.parametrize("latest, finished", [("3", None), ("4", 4), ("5", 5), ("", None)])
def test_a_run_is_finished_exactly_when_latest_reaches_num_steps(tmp_path, latest, finished):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text(latest)
    cfg = load_config(None, [f"log.dir={tmp_path}", "train.num_steps=4", "checkpoint.resume=true"])
    assert run_folder.finished_steps(cfg) == finished


def test_an_empty_metrics_file_is_not_a_run_and_one_line_is(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert not run_folder.holds_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert run_folder.holds_run(tmp_path)


def test_the_stop_request_is_the_files_existence_not_the_variable(tmp_path, monkeypatch):
    request = tmp_path / "stop"
    monkeypatch.setenv("MEGATRON_RL_STOP_REQUEST", str(request))
    assert not signals.stop_requested()
    request.write_text("")
    assert signals.stop_requested()


def test_a_bad_eval_file_is_named_by_its_own_key_not_data_path(tmp_path):
    good = tmp_path / "train.jsonl"
    good.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"question": "p", "answer": "a"}) + "\n")
    datasets = [{"name": "ok", "path": str(good)}, {"name": "bad", "path": str(bad)}]
    cfg = load_config(None, [f"data.path={good}", "eval.datasets=" + json.dumps(datasets)])
    with pytest.raises(ValueError, match=r"eval\.datasets\[1\]\.path"):
        check_inputs(cfg, load_tokenizer=False)


def test_only_identity_keys_both_configs_hold_are_compared():
    saved = {"model": {"hf_dir": "a"}, "data": {"path": "x.jsonl"}, "train": {"lr": 1.0}}
    now = {"model": {"hf_dir": "a", "new_knob": 3}, "data": {"path": "x.jsonl", "task": "sort"},
           "train": {"lr": 2.0}, "reward": {"name": "exact_match"}}
    assert run_folder.differences(saved, now) == []  # keys an older config.yaml lacks; lr is not identity
    now["model"]["hf_dir"] = "b"
    now["data"]["path"] = "y.jsonl"
    assert run_folder.differences(saved, now) == ['data.path: "x.jsonl" -> "y.jsonl"', 'model.hf_dir: "a" -> "b"']


def test_a_nan_or_missing_score_never_becomes_the_best(tmp_path):
    best = BestCheckpoint(tmp_path, "h/avg@4")
    best.scored(2, {"eval/h/avg@4": float("nan")}, latest_step=2)
    best.scored(3, {"eval/h/other": 1.0}, latest_step=3)
    assert best.step is None and not (tmp_path / "best").exists()
    best.scored(4, {"eval/h/avg@4": 0.1}, latest_step=4)
    best.scored(6, {"eval/h/avg@4": float("inf")}, latest_step=6)
    assert (tmp_path / "best").read_text() == "4"


def test_the_prompt_the_reward_sees_is_the_policys_even_when_a_row_has_a_prompt_column():
    from megatron_rl.loop.sampling import reward_extra

    item = PromptItem([1], "<templated q>", "A", 0, {"prompt": "raw q", "level": 3})
    assert reward_extra(item) == {"prompt": "<templated q>", "level": 3}


@pytest.mark.parametrize("made", ["config.yaml", "checkpoints", "checkpoints/step_000001.tmp", "metrics.jsonl"])
def test_each_file_a_run_leaves_alone_makes_the_folder_a_run(tmp_path, made):
    path = tmp_path / made
    if made.endswith((".yaml", ".jsonl")):
        path.write_text("step: 0\n")
    else:
        path.mkdir(parents=True)  # a checkpoints folder without `latest`: a first save killed midway
    assert run_folder.holds_run(tmp_path)
    assert not run_folder.holds_run(tmp_path / "other")


def test_rollout_minus_bf16_of_every_score_both_precisions_logged_and_never_of_the_time():
    from megatron_rl.loop.evaluate import _differences

    out = {"eval/h/avg@4": 0.75, "eval/h/bf16/avg@4": 0.5, "eval/h/time": 3.0, "eval/h/bf16/time": 1.0,
           "eval/h/bf16/pass@4": 1.0, "eval/g/avg@4": 0.1}
    assert _differences(out) == {"eval/h/rollout_minus_bf16/avg@4": 0.25}
