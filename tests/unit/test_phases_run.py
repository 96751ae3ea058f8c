"""The phases of one RL step on a real tiny run (embedded engine, Megatron actor, one process, no
warm start): what generate hands prepare, what prepare adds, what update_policy reports.

Expected values are worked out here from what the engine returned (a spy keeps its samples) and
from the components' public calls, never by the phases' own code. The end-to-end loop tests
(tests/e2e/test_rl_orchestration.py) check the same flow across steps; these check each phase's
numbers and knobs on their own, in a second or two each.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import megatron.core.tensor_parallel  # noqa: F401 - imported at collection, not inside each test
import pytest
import torch
import transformers  # noqa: F401

from megatron_rl.config import load_config
from megatron_rl.data.tasks import get_task
from megatron_rl.loop import build, phases
from megatron_rl.rewards import register_reward_fn
from megatron_rl.rewards.functions import position_match
from megatron_rl.rollout.base import Sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_rl_loop import EXAMPLES, TINY  # noqa: E402

N = 4  # samples per prompt
PROMPTS = 4  # prompts per step
BASE = [*TINY, "train.sft_steps=0", "train.colocated_protocol=false", "model.tiny_num_layers=1",
        f"rollout.n_samples_per_prompt={N}", f"data.prompts_per_step={PROMPTS}", "train.micro_batch_size=4",
        "rollout.max_new_tokens=6"]


@pytest.fixture
def make_run(tmp_path, parallel_restored):
    """make_run(*overrides) -> a built Run on the tiny fp8_calibrated config, its engine synced."""
    runs = []

    def make(*overrides: str, sync: bool = True):
        cfg = load_config(EXAMPLES / "fp8_calibrated.yaml", [*BASE, f"log.dir={tmp_path / f'run{len(runs)}'}",
                                                              *overrides])
        run = build.build_run(cfg)
        runs.append(run)
        if sync:
            run.sync.sync()
        return run

    yield make
    for run in runs:
        run.finish()


def spy_engine(run) -> list[tuple]:
    """Every engine.generate call as (prompt ids, sampling params, samples)."""
    calls, real = [], run.engine.generate

    def generate(prompt_ids, sampling):
        samples = real(prompt_ids, sampling)
        calls.append((prompt_ids, sampling, samples))
        return samples
    run.engine.generate = generate
    return calls


def spy_train_step(run, skipped: bool = False) -> list[dict]:
    """Every actor.train_step call as {"batch", "micro_batch_size", "result"}; `skipped` reports
    each update as skipped (a non-finite gradient) after it ran."""
    calls, real = [], run.actor.train_step

    def train_step(batch, loss_fn, **kw):
        result = real(batch, loss_fn, **kw)
        if skipped:
            result = {**result, "skipped": True}
        calls.append({"batch": batch, "result": result, **kw})
        return result
    run.actor.train_step = train_step
    return calls


def grpo(rewards: torch.Tensor, n: int = N) -> torch.Tensor:
    """(R - group mean) / (group's unbiased std + 1e-6), written out per group."""
    out = []
    for g in range(0, len(rewards), n):
        group = [float(r) for r in rewards[g:g + n]]
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        out += [(r - mean) / (std + 1e-6) for r in group]
    return torch.tensor(out)


def per_row(batch: dict, key: str) -> torch.Tensor:
    """A per-token quantity that is constant over each row's response (its value there)."""
    mask = batch["loss_mask"]
    return (batch[key] * mask).sum(1) / mask.sum(1).clamp(min=1)


def texts_of(run, samples) -> list[str]:
    return [run.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]


# --- generate ---------------------------------------------------------------------------------------


def test_generate_scores_every_response_and_normalises_it_within_its_group(make_run):
    run = make_run()
    calls = spy_engine(run)
    prompts = run.loader.next_batch()
    rollout = phases.generate(run, prompts, step=0)
    (ids, sampling, samples), = calls
    assert ids == [p.prompt_ids for p in prompts]
    assert [s.prompt_index for s in samples] == [i // N for i in range(PROMPTS * N)]
    texts = texts_of(run, samples)
    rewards = torch.tensor([position_match(t, prompts[i // N].answer) for i, t in enumerate(texts)])
    assert rewards.std() > 0  # not vacuous: the groups' advantages differ

    batch = rollout.batch
    for row, s in enumerate(samples):  # the batch holds the samples in order, response tokens masked in
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert batch["tokens"][row, :p + r].tolist() == list(s.prompt_ids) + list(s.response_ids)
        assert batch["loss_mask"][row].tolist() == [0.0] * p + [1.0] * r + [0.0] * (batch["tokens"].shape[1] - p - r)
        torch.testing.assert_close(batch["rollout_logprobs"][row, p:p + r], torch.tensor(s.rollout_logprobs))
    torch.testing.assert_close(per_row(batch, "advantages"), grpo(rewards), rtol=1e-5, atol=1e-5)
    assert "rewards" not in batch  # only a KL-in-reward run carries them on to prepare

    m, lengths = rollout.metrics, torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    valid = get_task("sort").valid_format
    expected = {
        "reward/mean": float(rewards.double().mean()), "reward/accuracy": float(rewards.double().mean()),
        "reward/std": float(rewards.double().std(unbiased=False)), "reward/overlong_penalty": 0.0,
        "reward/errors": 0.0, "reward/timeouts": 0.0,
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "dynamic_sampling/kept_frac": 1.0, "step/skipped": 0.0,
        "health/garbled_rate": sum(not valid(t) for t in texts) / len(texts),
    }
    assert {k: m[k] for k in expected} == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert not [k for k in m if k.startswith("dapo/")]
    assert 0.0 < m["time/rollout"] < 60.0


def test_sampling_follows_the_rollout_config(make_run):
    run = make_run("rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=5", "rollout.min_p=0.05",
                   "rollout.stop_token_ids=[3]", "rollout.stop=[';']", "rollout.max_new_tokens=5")
    calls = spy_engine(run)
    phases.generate(run, run.loader.next_batch(), step=0)
    (_, sampling, samples), = calls
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.7, 0.9, 5, 0.05)
    assert (sampling.max_new_tokens, sampling.n, tuple(sampling.stop)) == (5, N, (";",))
    assert list(sampling.stop_token_ids) == [run.tokenizer.eos_token_id, 3]
    assert max(len(s.response_ids) for s in samples) <= 5


def test_a_step_draws_its_own_seed_and_a_repeat_draws_the_same_samples(make_run):
    run = make_run()
    calls = spy_engine(run)
    prompts = run.loader.next_batch()
    for step in (3, 3, 4):
        phases.generate(run, prompts, step)
    seeds = [sampling.seed for _, sampling, _ in calls]
    responses = [[s.response_ids for s in samples] for *_, samples in calls]
    assert seeds[0] == seeds[1] != seeds[2]
    assert responses[0] == responses[1] != responses[2]
    # every (step, round) pair of a run gets its own seed, and the seed of the run (train.seed) counts
    drawn = {phases._step_seed(seed, step, salt) for seed in (0, 1) for step in range(50) for salt in (1, 1000, 1001)}
    assert len(drawn) == 2 * 50 * 3
    assert all(0 <= s < 2**31 - 1 for s in drawn)


def test_rollout_seed_replaces_the_runs_seed(make_run):
    run = make_run("train.seed=5")
    calls = spy_engine(run)
    prompts = run.loader.next_batch()
    phases.generate(run, prompts, 0)
    run.cfg.rollout.seed = 5
    phases.generate(run, prompts, 0)  # the same seed as the run's: the same draw
    run.cfg.rollout.seed = 6
    phases.generate(run, prompts, 0)
    seeds = [sampling.seed for _, sampling, _ in calls]
    assert seeds[0] == seeds[1] != seeds[2]


def _reward_components(response: str, answer: str) -> dict:
    return {"score": position_match(response, answer), "length": float(len(response)), "mean": 2.0}


def test_reward_components_are_averaged_and_a_reserved_name_is_renamed(make_run):
    register_reward_fn("test_phases_components", _reward_components)
    run = make_run("reward.name=test_phases_components")
    calls = spy_engine(run)
    prompts = run.loader.next_batch()
    m = phases.generate(run, prompts, step=0).metrics
    texts = texts_of(run, calls[0][2])
    assert m["reward/length"] == pytest.approx(sum(len(t) for t in texts) / len(texts))
    assert m["reward/fn_mean"] == 2.0  # "mean" is the loop's own reward/mean
    assert m["reward/mean"] == pytest.approx(
        sum(position_match(t, prompts[i // N].answer) for i, t in enumerate(texts)) / len(texts))


def test_the_reward_sees_the_text_before_a_stop_string_and_a_user_dataset_has_no_format_check(make_run, tmp_path):
    run = make_run("rollout.stop=['5']")
    prompts = run.loader.next_batch()[:1]
    responses = ["12359", "12", "5", "1234"]
    samples = [Sample(0, list(prompts[0].prompt_ids), run.tokenizer.encode(r, add_special_tokens=False), [0.0], "stop")
               for r in responses]
    rewards, metrics, garbled = phases._score(run, prompts, samples)
    seen = [r.split("5")[0] for r in responses]
    assert texts_of(run, samples) == responses  # the tokenizer round-trips them
    torch.testing.assert_close(rewards, torch.tensor([position_match(t, prompts[0].answer) for t in seen]))
    valid = get_task("sort").valid_format
    assert garbled.tolist() == [float(not valid(t)) for t in seen]
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0}
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt_text, "answer": p.answer}) + "\n" for p in prompts * 8))
    user = make_run(f"data.path={data}", "data.prompt_key=prompt", "data.answer_key=answer", sync=False)
    assert phases._score(user, prompts, samples)[2] is None


def test_overlong_shaping_penalises_long_responses_and_is_off_by_default(make_run):
    run = make_run("algo.overlong_buffer_len=2", "algo.overlong_penalty_factor=0.5", "rollout.max_new_tokens=6")
    samples = [Sample(0, [1], [5] * length, [0.0] * length, "stop") for length in (3, 4, 5, 6)]
    # DAPO: 0 up to max - buffer (4), then -factor * (length - 4) / buffer
    assert phases._overlong(run, samples).tolist() == [0.0, 0.0, -0.25, -0.5]
    run.cfg.algo.overlong_buffer_len = 0
    assert phases._overlong(run, samples).tolist() == [0.0] * 4


# --- dynamic sampling: rounds and the kept batch -----------------------------------------------------


def _round(samples, rewards, keep, penalty=None):
    n_rows = len(samples)
    return phases._Round(prompts=[], samples=samples, accuracy=torch.tensor(rewards, dtype=torch.float32),
                         penalty=torch.zeros(n_rows) if penalty is None else torch.tensor(penalty),
                         keep=torch.tensor(keep), garbled=None, stats={"reward/errors": 1.0, "reward/timeouts": 0.0},
                         components={}, counts=torch.tensor([sum(keep) // N]), seconds=0.5)


def _samples(first_token: int, lengths=(1, 2, 3, 4)):
    return [Sample(i // N, [1, 2], [first_token + i] * length, [-0.5] * length, "stop")
            for i, length in enumerate(lengths)]


def test_the_kept_batch_trains_the_kept_groups_and_pads_with_masked_rows(make_run):
    run = make_run(sync=False)
    dropped = _round(_samples(10), [1.0, 1.0, 1.0, 1.0], [False] * 4)
    kept = _round(_samples(20), [1.0, 0.0, 0.0, 1.0], [True] * 4)
    batch = phases._kept_batch(run, [dropped, kept], taken=[0, 1], most=2)
    assert batch["tokens"].shape[0] == 2 * N
    assert [int(row[2]) for row in batch["tokens"][:N]] == [20, 21, 22, 23]  # the kept group first
    assert batch["loss_mask"][:N].sum(1).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert batch["loss_mask"][N:].sum() == 0 and batch["advantages"][N:].abs().sum() == 0
    torch.testing.assert_close(per_row(batch, "advantages")[:N], grpo(torch.tensor([1.0, 0.0, 0.0, 1.0])))
    assert "rewards" not in batch
    run.cfg.algo.kl_reward_coef = 0.1
    batch = phases._kept_batch(run, [dropped, kept], taken=[0, 1], most=2)
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    first = _round(_samples(30), [0.0, 1.0, 1.0, 1.0], [True] * 4)
    batch = phases._kept_batch(run, [first, kept], taken=[1, 1], most=2)  # one group from each round
    assert [int(row[2]) for row in batch["tokens"]] == [30, 31, 32, 33, 20, 21, 22, 23]
    assert batch["rewards"].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    two = _round(_samples(40, (1, 2, 3, 4, 1, 2, 3, 4)), [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0], [True] * 8)
    batch = phases._kept_batch(run, [two], taken=[1], most=1)  # two kept groups, the plan takes one
    assert [int(row[2]) for row in batch["tokens"]] == [40, 41, 42, 43]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_each_group_estimator_gives_its_own_advantages(make_run, estimator):
    run = make_run(f"algo.advantage_estimator={estimator}", sync=False)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 1.0, 0.0])
    groups = rewards.view(-1, N)
    means = groups.mean(1, keepdim=True)
    expected = {  # by hand, per group of N
        "grpo": grpo(rewards),
        "dr_grpo": (groups - means).flatten(),  # no std division (Dr. GRPO)
        "rloo": (groups - (groups.sum(1, keepdim=True) - groups) / (N - 1)).flatten(),  # leave one out
    }[estimator]
    torch.testing.assert_close(phases._advantages(run, rewards, torch.ones(2 * N)), expected)


def test_rollout_metrics_cover_every_round_before_anything_is_dropped(make_run):
    run = make_run(sync=False)
    first = _round(_samples(10, (1, 2, 3, 6)), [1.0, 1.0, 1.0, 1.0], [False] * 4, penalty=[0.0, 0.0, 0.0, -0.5])
    second = _round(_samples(20), [1.0, 0.0, 0.0, 1.0], [True] * 4)
    first.samples[3].finish_reason = "length"
    second.components = {"reward/length": [1.0, 2.0, 3.0, 4.0]}
    m = phases._rollout_metrics(run, [first, second])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    assert m["reward/mean"] == pytest.approx(float(rewards.mean()))
    assert m["reward/std"] == pytest.approx(float(rewards.std(unbiased=False)))
    assert m["reward/accuracy"] == pytest.approx(6 / 8)
    assert m["reward/overlong_penalty"] == pytest.approx(-0.5 / 8)
    assert m["dynamic_sampling/kept_frac"] == 0.5
    assert m["response_length/mean"] == pytest.approx((1 + 2 + 3 + 6 + 1 + 2 + 3 + 4) / 8)
    assert m["response_length/max"] == 6.0 and m["response_length/clip_ratio"] == 1 / 8
    assert m["reward/length"] == pytest.approx(10 / 8)  # a round without the component counts 0
    assert m["reward/errors"] == 2.0 and m["reward/timeouts"] == 0.0  # counts add up over the rounds
    assert m["time/rollout"] == 1.0
    assert "health/garbled_rate" not in m  # no format check (a user dataset)


def _constant(response: str, answer: str) -> float:
    return 0.25


def test_a_step_whose_groups_all_drop_is_skipped_after_max_gen_batches(make_run, caplog):
    register_reward_fn("test_phases_constant", _constant)
    run = make_run("algo.dynamic_sampling=true", "algo.max_gen_batches=3", "reward.name=test_phases_constant")
    calls = spy_engine(run)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.loop.refill"):
        rollout = phases.generate(run, run.loader.next_batch(), step=2)
    assert any(m.startswith("step 2: 0 of 4 informative groups after algo.max_gen_batches=3") for m in caplog.messages)
    assert rollout.batch is None
    m = rollout.metrics
    assert (m["step/skipped"], m["dapo/gen_batches"], m["dapo/kept_groups"], m["dapo/kept_fraction"]) == (1.0, 3.0, 0.0, 0.0)
    assert m["dynamic_sampling/kept_frac"] == 0.0 and m["reward/mean"] == 0.25
    assert len(calls) == 3 and len({sampling.seed for _, sampling, _ in calls}) == 3  # each round its own draw
    assert len({tuple(ids[0]) for ids, _, _ in calls}) == 3  # and its own prompts


def test_dynamic_sampling_reports_the_kept_share_of_the_target(make_run):
    register_reward_fn("test_phases_varied", _varied)
    run = make_run("algo.dynamic_sampling=true", "reward.name=test_phases_varied")
    m = phases.generate(run, run.loader.next_batch(), step=0).metrics
    kept = m["dapo/kept_groups"]
    assert kept == run.cfg.data.prompts_per_step == 4 and m["dapo/kept_fraction"] == kept / 4 == 1.0


def test_dynamic_sampling_keeps_a_group_by_its_shaped_rewards(make_run, monkeypatch):
    """DAPO drops a group whose rewards (accuracy + overlong penalty) are all equal: a right but
    overlong answer (1 - 1) next to wrong short ones (0) carries no signal."""
    run = make_run("algo.dynamic_sampling=true")
    n = run.cfg.rollout.n_samples_per_prompt
    groups = run.cfg.data.prompts_per_step
    accuracy = torch.zeros(groups * n)
    accuracy[0::n] = 1.0  # one right answer per group
    penalty = torch.zeros(groups * n)
    penalty[0] = -1.0  # group 0: that answer ran over the length budget
    monkeypatch.setattr(phases, "_score_on_engine_rank", lambda run_, prompts, samples: (accuracy.clone(), {}, None))
    monkeypatch.setattr(phases, "_overlong", lambda run_, samples: penalty.clone())
    first = phases._sample_round(run, run.loader.next_batch(), 0, 0)
    assert first.keep.tolist() == [False] * n + [True] * (groups - 1) * n
    assert first.counts.tolist() == [groups - 1]


# --- prepare -----------------------------------------------------------------------------------------


def _rollout_batch(run, step=0):
    rollout = phases.generate(run, run.loader.next_batch(), step)
    return rollout.batch, dict(rollout.metrics)


def test_old_logprobs_are_the_fp8_trainers_and_nothing_is_skipped(make_run):
    run = make_run()
    batch, metrics = _rollout_batch(run)
    rows = batch["tokens"].shape[0]
    expected = run.actor.compute_logprobs(batch, micro_batch_size=rows, with_entropy=False, fp8=True)["logprobs"]
    bf16 = run.actor.compute_logprobs(batch, micro_batch_size=rows, with_entropy=False, fp8=False)["logprobs"]
    out = phases.prepare(run, batch, 0, metrics)
    on = batch["loss_mask"] > 0
    assert out is batch
    torch.testing.assert_close(out["old_logprobs"][on], expected[on])
    assert not torch.equal(out["old_logprobs"][on], bf16[on])  # the recipe matters here
    assert metrics["guard/nonfinite_logprobs"] == 0.0 and metrics["time/old_logprobs"] > 0
    assert "step/skipped" in metrics and metrics["step/skipped"] == 0.0
    assert phases.prepare(run, None, 0, metrics) is None


def test_rollout_logprobs_can_be_the_old_ones_and_a_nonfinite_one_skips_the_step(make_run, caplog):
    run = make_run("algo.use_rollout_logprobs=true")
    batch, metrics = _rollout_batch(run)
    out = phases.prepare(run, batch, 0, metrics)
    assert torch.equal(out["old_logprobs"], batch["rollout_logprobs"])
    out["old_logprobs"][0, 0] = 7.0
    assert out["rollout_logprobs"][0, 0] != 7.0  # a copy: the loss's TIS weights keep the rollout's
    batch, metrics = _rollout_batch(run, 1)
    prompt_pos = int((batch["loss_mask"][0] == 0).nonzero()[0])
    batch["rollout_logprobs"][0, prompt_pos] = float("nan")  # not a response token: not counted
    assert phases.prepare(run, batch, 1, metrics) is batch
    response = (batch["loss_mask"] > 0).nonzero()
    for row, col in response[:3].tolist():
        batch["rollout_logprobs"][row, col] = float("inf")
    with caplog.at_level(logging.WARNING, logger=phases.log.name):
        assert phases.prepare(run, batch, 1, metrics) is None
    assert metrics["guard/nonfinite_logprobs"] == 3.0 and metrics["step/skipped"] == 1.0
    assert "step 1: 3 non-finite old log-probs on response tokens: step skipped" in caplog.messages
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    bad = torch.tensor([[float("nan"), float("inf"), 0.0], [0.0, float("-inf"), float("nan")]])
    for key in ("old_logprobs", "old_logprobs_ref", "ref_logprobs"):  # every log-prob the loss reads
        assert phases._count_nonfinite(run, {"loss_mask": mask, key: bad}) == 2.0, key  # response tokens only
    assert phases._count_nonfinite(run, {"loss_mask": mask, "old_logprobs": bad, "ref_logprobs": bad}) == 4.0


def test_old_logprobs_in_bf16_when_configured(make_run):
    """algo.old_logprob_precision=bf16: the old log-probs are the BF16 path's at theta_old, not the
    recipe's (the two differ here: the test above)."""
    run = make_run("algo.old_logprob_precision=bf16", "calib.enabled=false")
    batch, metrics = _rollout_batch(run)
    rows, on = batch["tokens"].shape[0], batch["loss_mask"] > 0
    bf16 = run.actor.compute_logprobs(batch, micro_batch_size=rows, with_entropy=False, fp8=False)["logprobs"]
    out = phases.prepare(run, batch, 0, metrics)
    torch.testing.assert_close(out["old_logprobs"][on], bf16[on])


@pytest.mark.parametrize("overrides, skipped", [
    (("train.num_mini_batches=1",), True),  # NeMo-RL's setting: nothing needs pi_old before the update
    (("train.num_mini_batches=2",), False),  # the second mini-batch follows an update: it needs pi_old
    (("train.num_mini_batches=1", "train.ppo_epochs=2"), False),
    (("train.num_mini_batches=1", "algo.kl_loss_coef=0.1"), False),  # kl/ref_mean reads pi_old
])
def test_forced_ratio_skips_the_old_forward_only_when_nothing_else_needs_it(make_run, overrides, skipped):
    run = make_run("algo.force_on_policy_ratio=true", "calib.enabled=false", *overrides)
    batch, metrics = _rollout_batch(run)
    calls = []
    real = run.actor.compute_logprobs
    run.actor.compute_logprobs = lambda *a, **k: calls.append(k["fp8"]) or real(*a, **k)
    out = phases.prepare(run, batch, 0, metrics)
    assert out is batch and ("old_logprobs" not in out) == skipped
    assert calls == ([] if skipped else [True])
    if skipped:  # and the step trains on the forward's own log-probs: the ratio the loss used is 1
        m = phases.update_policy(run, out, 0)
        assert m["log_ratio/std"] == 0.0 and m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0
        assert m["noise/log_ratio_std_at_old"] == 0.0


def _k2(old: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref - old) ** 2


def test_reference_kl_is_measured_against_the_frozen_initial_weights(make_run):
    run = make_run("algo.kl_loss_coef=0.1", "algo.kl_loss_type=k2", "algo.ref_precision=train", "train.lr=1e-2")
    batch, metrics = _rollout_batch(run)
    phases.prepare(run, batch, 0, metrics)
    assert metrics["kl/ref_mean"] == 0.0  # before any update the actor is the reference
    phases.update_policy(run, batch, 0)
    batch, metrics = _rollout_batch(run, 1)
    out = phases.prepare(run, batch, 1, metrics)
    rows, on = batch["tokens"].shape[0], batch["loss_mask"] > 0
    ref = run.ref.compute_logprobs(batch, micro_batch_size=rows, with_entropy=False, fp8=True)["logprobs"]
    torch.testing.assert_close(out["ref_logprobs"][on], ref[on])
    expected = float(_k2(out["old_logprobs"][on], ref[on]).double().mean())
    assert expected > 1e-6
    assert metrics["kl/ref_mean"] == pytest.approx(expected, rel=1e-4)
    assert 0 < metrics["time/ref_logprobs"] < 60 and "kl/reward_penalty" not in metrics


def test_the_reference_pass_runs_inside_the_memory_protocols_window(make_run):
    run = make_run("algo.kl_loss_coef=0.1")
    events, real = [], run.ref.compute_logprobs

    class Memory:
        @contextlib.contextmanager
        def reference_on_device(self):
            events.append("in")
            yield
            events.append("out")

    def compute_logprobs(*a, **kw):
        events.append("reference forward")
        return real(*a, **kw)
    run.ref.compute_logprobs = compute_logprobs
    batch, metrics = _rollout_batch(run)
    phases.prepare(run, batch, 0, metrics, Memory())
    assert events == ["in", "reference forward", "out"]


def _rpp(rewards: torch.Tensor, counts: torch.Tensor, n: int = N) -> torch.Tensor:
    """REINFORCE++ baseline by hand: group-centred rewards whitened over response tokens (unbiased)."""
    centred = [float(r) - sum(float(x) for x in rewards[g // n * n:g // n * n + n]) / n for g, r in enumerate(rewards)]
    tokens = [c for c, k in zip(centred, counts.tolist()) for _ in range(int(k))]
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1)
    return torch.tensor([(c - mean) / math.sqrt(var + 1e-8) for c in centred])


def test_reinforce_plus_plus_whitens_over_the_kept_rows_only(make_run):
    run = make_run("algo.advantage_estimator=reinforce_plus_plus_baseline", "algo.dynamic_sampling=true")
    dropped = _round(_samples(10), [1.0, 1.0, 1.0, 1.0], [False] * 4)
    kept = _round(_samples(20), [1.0, 0.0, 0.0, 1.0], [True] * 4)
    batch = phases._kept_batch(run, [dropped, kept], taken=[0, 1], most=2)  # 4 kept rows, then 4 masked
    expected = _rpp(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    torch.testing.assert_close(per_row(batch, "advantages")[:N], expected)
    assert batch["advantages"][N:].abs().sum() == 0


def test_kl_in_reward_whitens_the_kept_rows_only_and_leaves_the_padding_at_zero(make_run):
    run = make_run("algo.kl_reward_coef=0.5", "algo.kl_reward_type=k2", "algo.ref_precision=bf16",
                   "algo.advantage_estimator=reinforce_plus_plus_baseline", "algo.dynamic_sampling=true")
    dropped = _round(_samples(10), [1.0, 1.0, 1.0, 1.0], [False] * 4)
    kept = _round(_samples(20), [1.0, 0.0, 0.0, 1.0], [True] * 4)
    batch = phases._kept_batch(run, [dropped, kept], taken=[0, 1], most=2)  # 4 kept rows, then 4 masked
    metrics = {}
    out = phases.prepare(run, batch, 0, metrics)
    on = out["loss_mask"]
    penalty = 0.5 * (_k2(out["old_logprobs"], out["ref_logprobs"]) * on).sum(-1)[:N]  # coef x sum of k2
    assert penalty.min() > 0  # FP8 against BF16: every kept row pays something
    counts = on.sum(-1)[:N]
    assert counts.tolist() == [1.0, 2.0, 3.0, 4.0]
    expected = _rpp(torch.tensor([1.0, 0.0, 0.0, 1.0]) - penalty, counts)
    torch.testing.assert_close(per_row(out, "advantages")[:N], expected, rtol=1e-4, atol=1e-4)
    assert out["advantages"][N:].abs().sum() == 0 and torch.isfinite(out["advantages"]).all()
    assert metrics["kl/reward_penalty"] == pytest.approx(float(penalty.double().mean()), rel=1e-4)


def test_kl_in_reward_takes_the_penalty_off_each_reward_before_the_advantages(make_run):
    run = make_run("algo.kl_reward_coef=0.5", "algo.kl_reward_type=k1", "algo.ref_precision=bf16", "train.lr=1e-2")
    calls = spy_engine(run)
    prompts = run.loader.next_batch()
    rollout = phases.generate(run, prompts, 0)
    batch, metrics = rollout.batch, dict(rollout.metrics)
    texts = texts_of(run, calls[0][2])
    rewards = torch.tensor([position_match(t, prompts[i // N].answer) for i, t in enumerate(texts)])
    torch.testing.assert_close(batch["rewards"], rewards)
    out = phases.prepare(run, batch, 0, metrics)
    on = out["loss_mask"]
    kl = (out["old_logprobs"] - out["ref_logprobs"]) * on  # k1, old (FP8) vs reference (BF16)
    penalty = 0.5 * kl.sum(-1)
    assert penalty.abs().max() > 1e-4  # FP8 against BF16: not vacuous
    torch.testing.assert_close(per_row(out, "advantages"), grpo(rewards - penalty), rtol=1e-4, atol=1e-4)
    assert metrics["kl/reward_penalty"] == pytest.approx(float(penalty.double().mean()), rel=1e-4, abs=1e-7)
    assert "rewards" not in out


# --- update_policy -----------------------------------------------------------------------------------


def _varied(response: str, answer: str) -> float:
    """A reward that differs between almost any two texts (an untrained model rarely scores on sort)."""
    return sum(map(ord, response)) % 7 / 7


def test_update_policy_trains_every_mini_batch_of_every_epoch_and_reports_the_mean_grad_norm(make_run):
    register_reward_fn("test_phases_varied", _varied)
    run = make_run("train.ppo_epochs=2", "train.num_mini_batches=2", "calib.period=2", "reward.name=test_phases_varied")
    batch, metrics = _rollout_batch(run)
    phases.update_policy(run, phases.prepare(run, batch, 0, metrics), 0)  # step 0 calibrates
    batch, metrics = _rollout_batch(run, 1)
    batch = phases.prepare(run, batch, 1, metrics)
    calls = spy_train_step(run)
    out = phases.update_policy(run, batch, 1)  # step 1 does not
    assert len(calls) == 4
    for epoch in (calls[:2], calls[2:]):  # each epoch: the batch's rows, once each
        tokens = sorted(map(tuple, torch.cat([c["batch"]["tokens"] for c in epoch])[:, :batch["tokens"].shape[1]].tolist()))
        assert tokens == sorted(map(tuple, batch["tokens"].tolist()))
    norms = [c["result"]["grad_norm"] for c in calls]
    assert min(norms) > 0 and out["grad_norm"] == pytest.approx(sum(norms) / 4)
    assert out["guard/skipped_updates"] == 0.0
    assert (out["calib/low"], out["calib/high"]) == run.controller.bounds
    assert out["calib/high_unbounded"] == 0.0 and 0 < out["time/train"] < 120
    assert not [k for k in out if k.startswith("shadow/")]
    # the first mini-batch trains at theta_old: its ratios are exactly 1 (the same FP8 forward)
    assert out["noise/log_ratio_std_at_old"] == 0.0 and out["noise/pg_clipfrac_at_old"] == 0.0
    assert "noise/clip_low_neg_at_old" in out


def test_skipped_updates_are_counted(make_run):
    run = make_run("train.num_mini_batches=2")
    batch, metrics = _rollout_batch(run, 1)
    batch = phases.prepare(run, batch, 1, metrics)
    spy_train_step(run, skipped=True)
    assert phases.update_policy(run, batch, 1)["guard/skipped_updates"] == 2.0


def test_a_calibration_step_calibrates_on_its_last_mini_batch_and_dumps_what_it_used(make_run, tmp_path):
    dump = tmp_path / "not" / "yet" / "calib"  # made, parents and all
    run = make_run("calib.period=2", f"calib.dump_dir={dump}", "train.num_mini_batches=2", "train.lr=1e-2")
    batch, metrics = _rollout_batch(run, 2)
    batch = phases.prepare(run, batch, 2, metrics)
    calls = spy_train_step(run)
    out = phases.update_policy(run, batch, 2)
    assert out["calib/num_calibrations"] == 1.0 and out["calib/skipped"] == 0.0
    shadow = {k for k in out if k.startswith("shadow/")}
    assert shadow == set(phases.SHADOW_KEYS.values())
    assert (out["calib/low"], out["calib/high"]) == run.controller.bounds
    saved = torch.load(dump / "calib_000002.pt", weights_only=False)
    assert saved["step"] == 2 and saved["bounds"] == run.controller.bounds
    hist = run.controller.new_histogram()
    assert (saved["eps_low"], saved["eps_high"], saved["num_bins"], saved["log_ratio_range"]) == (
        hist.eps_low, hist.eps_high, hist.num_bins, hist.log_ratio_range)
    last = calls[-1]["batch"]
    assert len(saved["micro_batches"]) == 2  # the last mini-batch's 8 rows, 4 per micro-batch
    assert list(saved["input_names"]) == list(phases.HIST_INPUTS)
    inputs = {k: torch.cat([mb[i] for mb in saved["micro_batches"]])
              for i, k in enumerate(saved["input_names"])}
    width = inputs["loss_mask"].shape[1]
    for key in ("loss_mask", "advantages", "old_logprobs", "rollout_logprobs"):
        torch.testing.assert_close(inputs[key], last[key][:, :width])
    torch.testing.assert_close(saved["local_payload"], saved["payload"])  # one rank: nothing to add
    a = run.cfg.algo
    assert saved["algo"] == {"use_tis": True, "tis_mode": a.tis_mode, "tis_clip": 2.0,
                             "loss_agg_mode": a.loss_agg_mode, "level": "token"}
    # the next step does not calibrate: no shadow pass, no dump; the one after dumps into the same folder
    batch, metrics = _rollout_batch(run, 3)
    out = phases.update_policy(run, phases.prepare(run, batch, 3, metrics), 3)
    assert not [k for k in out if k.startswith("shadow/")] and not (dump / "calib_000003.pt").exists()
    batch, metrics = _rollout_batch(run, 4)
    phases.update_policy(run, phases.prepare(run, batch, 4, metrics), 4)
    assert sorted(p.name for p in dump.iterdir()) == ["calib_000002.pt", "calib_000004.pt"]


def test_diagnose_only_logs_what_calibration_would_set_and_keeps_the_default_bounds(make_run):
    run = make_run("calib.enabled=false", "calib.diagnose=true", "calib.period=1", "algo.eps_clip=0.3",
                   "algo.eps_clip_high=0.25")
    batch, metrics = _rollout_batch(run)
    out = phases.update_policy(run, phases.prepare(run, batch, 0, metrics), 0)
    assert (out["calib/low"], out["calib/high"]) == (0.7, 1.25)
    assert set(phases.DIAGNOSE_KEYS.values()) <= set(out)
    assert not [k for k in out if k.startswith("calib/") and k not in ("calib/low", "calib/high", "calib/high_unbounded")]
    assert {k for k in out if k.startswith("shadow/")} == set(phases.SHADOW_KEYS.values())


def test_cispo_has_no_lower_bound(make_run):
    run = make_run("calib.enabled=false", "algo.loss_mode=cispo", "algo.eps_clip=1.0", "algo.eps_clip_high=4.0")
    assert phases._bounds(run) == (0.0, 5.0)


def test_samples_are_dumped_with_their_rewards_and_advantages_on_the_steps_asked(make_run):
    run = make_run("log.dump_samples_every=2", "log.dump_samples_num=3", "rollout.stop=[';']")
    calls = spy_engine(run)
    prompts = run.loader.next_batch()
    phases.generate(run, prompts, step=1)
    assert not (Path(run.cfg.log.dir) / "samples").exists()
    phases.generate(run, prompts, step=2)
    samples = calls[-1][2]
    records = [json.loads(line) for line in (Path(run.cfg.log.dir) / "samples" / "step_000002.jsonl").read_text().splitlines()]
    texts = [t.split(";")[0] for t in texts_of(run, samples)]
    rewards = torch.tensor([position_match(t, prompts[i // N].answer) for i, t in enumerate(texts)])
    advantages = grpo(rewards)
    assert len(records) == 3
    for i, r in enumerate(records):
        assert (r["response"], r["answer"], r["prompt"]) == (texts[i], prompts[0].answer, prompts[0].prompt_text)
        assert r["reward"] == pytest.approx(float(rewards[i])) and r["advantage"] == pytest.approx(float(advantages[i]), abs=1e-5)
        assert (r["response_length"], r["finish_reason"]) == (len(samples[i].response_ids), samples[i].finish_reason)


def test_a_dump_of_a_dynamic_sampling_round_has_the_components_and_whitened_advantages(make_run):
    run = make_run("log.dump_samples_num=8", "algo.advantage_estimator=reinforce_plus_plus_baseline")
    prompts = run.loader.next_batch()[:2]
    first = _round(_samples(10) + _samples(20), [1.0] * 4 + [1.0, 0.0, 0.0, 1.0], [False] * 4 + [True] * 4)
    for s_ in first.samples[N:]:
        s_.prompt_index = 1
    first.prompts = prompts
    first.components = {"reward/length": [float(i) for i in range(8)]}
    phases._dump_samples(run, 5, first)
    records = [json.loads(line) for line in (Path(run.cfg.log.dir) / "samples" / "step_000005.jsonl").read_text().splitlines()]
    counts = torch.tensor([0.0] * 4 + [1.0, 2.0, 3.0, 4.0])  # a dropped group counts no tokens
    expected = _rpp(torch.tensor([1.0] * 4 + [1.0, 0.0, 0.0, 1.0]), counts)
    assert [r["advantage"] for r in records] == pytest.approx(expected.tolist(), abs=1e-5)
    assert [r["reward/length"] for r in records] == [float(i) for i in range(8)]
    assert sorted(records[0]) == sorted(["index", "prompt", "response", "answer", "reward", "reward/length",
                                         "advantage", "response_length", "finish_reason"])
    assert [r["answer"] for r in records] == [prompts[0].answer] * 4 + [prompts[1].answer] * 4


def _splits(run, step: int, global_seed: int = 0) -> list[list[int]]:
    """update_policy's mini-batches at `step`, as lists of row ids (the first token after the prompt),
    with the global RNG seeded `global_seed` just before (build_run seeds it too)."""
    batch, metrics = _rollout_batch(run)
    batch = phases.prepare(run, batch, step, metrics)
    keys = [tuple(row.tolist()) for row in batch["tokens"]]
    calls = spy_train_step(run)
    torch.manual_seed(global_seed)
    phases.update_policy(run, batch, step)
    width = batch["tokens"].shape[1]
    return [sorted(keys.index(tuple(r.tolist())) for r in c["batch"]["tokens"][:, :width]
                   if tuple(r.tolist()) in keys) for c in calls]


def test_the_mini_batch_split_is_drawn_from_the_seed_and_step_alone(make_run):
    """A resumed run trains the same mini-batches as an uninterrupted one: the split never reads the
    global RNG, whatever ran before it."""
    first = _splits(make_run("train.num_mini_batches=4", "calib.enabled=false"), 1, global_seed=1)
    again = _splits(make_run("train.num_mini_batches=4", "calib.enabled=false"), 1, global_seed=2)
    assert first == again and len(first) == 4
    assert sorted(i for part in first for i in part) == list(range(PROMPTS * N))
    assert first != [list(range(i, i + 4)) for i in range(0, 16, 4)]  # shuffled


def test_the_last_mini_batch_calibrates_and_the_chunk_size_reaches_the_trainer(make_run):
    run = make_run("train.num_mini_batches=3", "calib.period=1", "train.logprob_chunk_size=3")
    batch, metrics = _rollout_batch(run)
    batch = phases.prepare(run, batch, 0, metrics)
    calls = spy_train_step(run)
    phases.update_policy(run, batch, 0)
    assert ["ratio_ref" in c["batch"] for c in calls] == [False, False, True]
    assert {c["logprob_chunk_size"] for c in calls} == {3}


def test_packed_micro_batches_give_the_padded_log_probs_back_in_the_batch_layout(make_run):
    run = make_run("train.max_tokens_per_micro_batch=96")
    batch, metrics = _rollout_batch(run)
    out = phases.prepare(run, batch, 0, metrics)
    rows, on = batch["tokens"].shape[0], batch["loss_mask"] > 0
    padded = run.actor.compute_logprobs(batch, micro_batch_size=rows, with_entropy=False, fp8=True)["logprobs"]
    assert out["old_logprobs"].shape == batch["tokens"].shape
    torch.testing.assert_close(out["old_logprobs"][on], padded[on], rtol=1e-5, atol=1e-5)
    assert 0 < metrics["time/old_logprobs"] < 60


def test_the_old_log_prob_pass_records_the_kv_amax_of_a_calibrated_fp8_kv_cache(make_run):
    run = make_run("rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.kv_scales=calibrated")
    before = run.kv_calibration.amax.clone()
    batch, metrics = _rollout_batch(run)
    phases.prepare(run, batch, 0, metrics)
    after = run.kv_calibration.amax
    assert not torch.equal(before, after) and bool((after < before).all())  # measured, below E4M3's max


def test_the_bf16_shadow_ratio_is_one_at_theta_old(make_run, tmp_path):
    """One mini-batch: the calibration mini-batch trains at theta_old, so its BF16 ratio is exactly 1
    on every token (masked ones: exp(0)); an FP8 forward or a wrong sign would move it."""
    run = make_run("train.num_mini_batches=1", "calib.period=1", f"calib.dump_dir={tmp_path / 'dump'}")
    batch, metrics = _rollout_batch(run)
    phases.update_policy(run, phases.prepare(run, batch, 0, metrics), 0)
    saved = torch.load(tmp_path / "dump" / "calib_000000.pt", weights_only=False)
    names = list(saved["input_names"])
    for mb in saved["micro_batches"]:
        assert torch.equal(mb[names.index("ratio_ref")], torch.ones_like(mb[0]))


def _calibration_out(**flags) -> dict:
    out = {"calib/skipped": 0.0, "calib/skipped_empty": 0.0, "calib/skipped_crossed": 0.0,
           "calib/high_unattainable": 0.0, "calib/high_edge": 0.0, "calib/high_no_bf16_upper_clip": 0.0,
           "calib/high_undefined": 0.0, "calib/low_edge": 0.0}
    out.update({f"calib/{k}": v for k, v in flags.items()})
    return out


def test_a_skipped_calibration_warns_with_its_reason_and_a_kept_bound_is_named(make_run, caplog):
    run = make_run(sync=False)
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.phases"):
        phases._log_calibration(_calibration_out(skipped=1.0, skipped_crossed=1.0), 7)
        phases._log_calibration(_calibration_out(high_edge=1.0, low_edge=1.0, high_undefined=1.0), 8)
        phases._log_calibration(_calibration_out(), 9)
        bounds = run.controller.bounds  # a calibration mini-batch without a token: skipped, logged with its step
        out = phases._calibrate(run, [{phases.HIST_KEY: run.controller.new_histogram().payload}], 11)
    assert out["calib/skipped_empty"] == 1.0 and run.controller.bounds == bounds
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "step 7: calibration skipped (calib/skipped_crossed); bounds kept, retried next step"),
        ("INFO", "step 8: previous bound kept (high_edge, high_undefined, low_edge)"),
        ("WARNING", "step 11: calibration skipped (calib/skipped_empty); bounds kept, retried next step")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.phases"):
        for name in ("high_unattainable", "high_no_bf16_upper_clip"):
            phases._log_calibration(_calibration_out(**{name: 1.0}), 3)
    assert [r.getMessage() for r in caplog.records] == [
        "step 3: previous bound kept (high_unattainable)", "step 3: previous bound kept (high_no_bf16_upper_clip)"]


def test_one_model_parallel_rank_has_nothing_to_compare(make_run):
    run = make_run(sync=False)
    phases.assert_same_across_model_parallel((0.8, 1.2), run.parallel)  # TP = PP = 1: no collective


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_the_bounds_are_compared_over_the_model_parallel_group_whatever_its_shape(monkeypatch, tp, pp):
    """The gather itself runs on real ranks (tests/dist/test_calib_model_parallel.py); here, which
    layouts gather, on which group, and what a mismatch anywhere in the group does."""
    group, calls = object(), []
    parallel = SimpleNamespace(tp_size=tp, pp_size=pp, mp_group=group)
    for gathered, differs in (([(0.8, 1.2)] * (tp * pp)), False), ([(0.8, 1.2)] * (tp * pp - 1) + [(0.8, 1.3)], True):
        monkeypatch.setattr(phases.collectives, "all_gather_objects",
                            lambda obj, g, out=gathered: calls.append((obj, g)) or list(out))
        if differs and tp * pp > 1:
            with pytest.raises(RuntimeError, match=r"differ across the model-parallel group: .*\(0\.8, 1\.3\)"):
                phases.assert_same_across_model_parallel([0.8, 1.2], parallel)
        else:
            phases.assert_same_across_model_parallel([0.8, 1.2], parallel)
    assert calls == ([] if tp * pp == 1 else [((0.8, 1.2), group)] * 2)


def test_the_calibration_histogram_keeps_the_tokens_the_runs_icepop_bounds_keep(make_run):
    """IcePop (MIS) weighs a token by its rollout ratio w = exp(old - rollout) where w lies in
    [icepop_low, icepop_high], else 0; the histogram must weigh the tokens as the loss does."""
    run = make_run("algo.use_tis=true", "algo.tis_mode=icepop", "algo.icepop_low=0.9", "algo.icepop_high=2.0",
                   sync=False)
    rollout_ratio = torch.tensor([[0.3, 0.95, 1.5, 3.0], [0.6, 1.0, 1.9, 7.0]])
    old = torch.full((2, 4), -0.5)
    mb = {"loss_mask": torch.ones(2, 4), "old_logprobs": old, "rollout_logprobs": old - rollout_ratio.log(),
          "ratio_ref": torch.ones(2, 4), "advantages": torch.tensor([[1.0] * 4, [-1.0] * 4])}
    logprobs = old + torch.tensor([[0.1, -0.2, 0.3, 0.0], [-0.3, 0.2, 0.05, -0.1]])
    expected = run.controller.new_histogram()
    kept = ((rollout_ratio >= 0.9) & (rollout_ratio <= 2.0)).float()  # the default bounds (0.5, 5) keep more
    expected.add((logprobs - old).exp(), mb["ratio_ref"], mb["advantages"], mb["loss_mask"],
                 weights=rollout_ratio * kept)
    torch.testing.assert_close(phases._histogram_payload(run, logprobs, mb), expected.payload)


def test_a_sequence_level_histogram_counts_only_the_tokens_rejection_sampling_keeps(make_run):
    """GSPO calibrates one entry per sequence, its ratio the mean log-ratio over the tokens the loss
    keeps: token_k1 rejection drops the tokens whose exp(rollout - old) leaves [low, threshold]."""
    run = make_run("precision.train_recipe=tensorwise", "calib.enabled=true", "algo.loss_mode=gspo",
                   "algo.eps_clip=3e-4", "algo.eps_clip_high=4e-4", "calib.level=sequence",
                   "calib.log_ratio_range=0.01", "calib.low_min=0.99", "calib.high_max=1.01",
                   "algo.rollout_rs=token_k1", "algo.rollout_rs_threshold=2.0", "algo.rollout_rs_threshold_low=0.9",
                   "algo.use_tis=false",
                   sync=False)
    k1_ratio = torch.tensor([[0.3, 0.95, 1.5, 3.0], [0.6, 1.0, 1.9, 7.0]])  # pi_rollout / pi_old (verl's token_k1)
    mb = {"loss_mask": torch.ones(2, 4), "old_logprobs": torch.zeros(2, 4), "rollout_logprobs": k1_ratio.log(),
          "ratio_ref": torch.ones(2, 4), "advantages": torch.tensor([[1.0] * 4, [-1.0] * 4])}
    logprobs = torch.tensor([[0.001, -0.002, 0.003, 0.0], [-0.003, 0.002, 0.0005, -0.001]])
    kept = (k1_ratio >= 0.9) & (k1_ratio <= 2.0)
    assert kept.sum() == 4  # a mask without rejection would keep all 8
    from megatron_rl.algo.policy_loss import loss_token_weights

    weights = loss_token_weights(mb["loss_mask"], run.cfg.algo.loss_agg_mode, mb["old_logprobs"], mb["rollout_logprobs"],
                                 rollout_rs="token_k1", rollout_rs_threshold=2.0, rollout_rs_threshold_low=0.9)
    expected = run.controller.new_histogram()  # the loss's own token weights, over the tokens kept by hand
    expected.add_sequences(logprobs, torch.zeros(2, 4), mb["advantages"], kept, weights=weights,
                           dual_clip=run.cfg.algo.eps_clip_c)
    got = phases._histogram_payload(run, logprobs, mb)
    assert got.sum() > 0
    torch.testing.assert_close(got, expected.payload)


def _bonus(response: str, answer: str, bonus: float = -1.0) -> float:
    return bonus


def test_the_reward_gets_each_prompts_extra_dataset_columns(make_run):
    from dataclasses import replace

    register_reward_fn("test_phases_run_bonus", _bonus)
    run = make_run("reward.name=test_phases_run_bonus", sync=False)
    prompts = [replace(p, extra={"bonus": 0.25 * (i + 1)}) for i, p in enumerate(run.loader.next_batch()[:2])]
    samples = [Sample(i // N, list(prompts[i // N].prompt_ids), [5], [0.0], "stop") for i in range(2 * N)]
    rewards, _, _ = phases._score(run, prompts, samples)
    assert rewards.tolist() == [0.25] * N + [0.5] * N  # each response gets its own prompt's column


def _prompt_length(response: str, answer: str, prompt: str) -> float:
    return float(len(prompt))


def test_the_training_reward_gets_each_samples_prompt(make_run):
    register_reward_fn("test_phases_run_prompt", _prompt_length)
    run = make_run("reward.name=test_phases_run_prompt", sync=False)
    batch = run.loader.next_batch()
    first = batch[0]
    other = next(p for p in batch if len(p.prompt_text) != len(first.prompt_text))  # tells the two apart
    prompts = [first, other]
    samples = [Sample(i // N, list(prompts[i // N].prompt_ids), [5], [0.0], "stop") for i in range(2 * N)]
    rewards, metrics, _ = phases._score(run, prompts, samples)
    assert rewards.tolist() == [float(len(first.prompt_text))] * N + [float(len(other.prompt_text))] * N
    assert metrics["reward/errors"] == 0.0
