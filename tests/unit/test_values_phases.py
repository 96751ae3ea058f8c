"""Value tests of loop/phases.py through its own code around a scripted engine and a toy actor
(tests/doubles/toy_phase_run.py): what the optimizer receives for every crossing of mini-batches x
epochs x micro-batch size x loss aggregation (the rows of each update, the loss divided by that
mini-batch's own count), the metrics generate emits from groups of different rewards and lengths,
dynamic sampling with refill (which rows train, their advantages, the dapo/* numbers), and the
non-finite guard on response tokens only. Expected values are computed here by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.config import load_config
from megatron_rl.loop import phases
from megatron_rl.loop.batch import mini_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from toy_phase_run import first_digit, prompts, toy_run  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BASE = ["calib.enabled=false", "rollout.max_new_tokens=4"]
RUNNER = None


@pytest.fixture(scope="module", autouse=True)
def _one_reward_pool():
    """One reward worker for the module (a fork per hypothesis example costs more than the test)."""
    global RUNNER
    from megatron_rl.rewards.runner import RewardRunner

    RUNNER = RewardRunner(first_digit, timeout_s=30.0)
    yield
    RUNNER.close()


def _cfg(*overrides):
    return load_config(None, [*BASE, *overrides])


def _grpo(rewards: list[float]) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def _row_keys(batch) -> list[tuple]:
    """Each real row (loss_mask > 0) as its token tuple without padding."""
    keep = batch["loss_mask"].sum(1) > 0
    return [tuple(t for t in row.tolist() if t != 0) for row in batch["tokens"][keep]]


def _expected_loss(mb, mode: str) -> float:
    """The mini-batch's loss at ratio 1: -A per token, aggregated over THIS mini-batch's count."""
    mask, adv = mb["loss_mask"], mb["advantages"]
    row_adv = (adv * mask).sum(1) / mask.sum(1).clamp(min=1)
    lengths, rows = mask.sum(1), int((mask.sum(1) > 0).sum())
    if mode == "token-mean":
        return float(-(adv * mask).sum() / max(float(mask.sum()), 1.0))
    if mode == "seq-mean-token-mean":
        return float(-row_adv.sum() / max(rows, 1))
    return float(-(row_adv * lengths).sum() / max(rows, 1))  # seq-mean-token-sum


def _count(mb, mode: str) -> float:
    mask = mb["loss_mask"]
    return float(mask.sum()) if mode == "token-mean" else float((mask.sum(1) > 0).sum())


GROUPS = ["1100", "3010", "2222", "0123", "4001"]  # one group without variance (advantage 0)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 2), st.sampled_from([1, 3, 8]),
       st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]))
def test_each_update_gets_its_mini_batchs_rows_and_a_loss_over_that_mini_batch(num_mb, epochs, mbs, mode):
    cfg = _cfg("rollout.n_samples_per_prompt=4", f"data.prompts_per_step={len(GROUPS)}",
               f"train.num_mini_batches={num_mb}",
               f"train.ppo_epochs={epochs}", f"train.micro_batch_size={mbs}", f"algo.loss_agg_mode={mode}")
    run = toy_run(cfg, rewards=RUNNER)
    rollout = phases.generate(run, prompts(run.tokenizer, GROUPS), step=3)
    metrics = dict(rollout.metrics)
    batch = phases.prepare(run, rollout.batch, 3, metrics)
    out = phases.update_policy(run, batch, 3)
    calls, rows = run.actor.calls, 4 * len(GROUPS)
    assert len(calls) == epochs * num_mb
    sizes = [rows // num_mb + (i < rows % num_mb) for i in range(num_mb)]  # near-equal parts, larger first
    everything = sorted(_row_keys(batch))
    orders = []
    for e in range(epochs):
        epoch = calls[e * num_mb:(e + 1) * num_mb]
        assert [len(_row_keys(c["batch"])) for c in epoch] == sizes
        keys = [k for c in epoch for k in _row_keys(c["batch"])]
        assert sorted(keys) == everything  # every row once per epoch
        orders.append(keys)
        for c in epoch:  # padded to whole micro-batches of micro_batch_size rows
            assert c["micro_batch_size"] == mbs and c["batch"]["tokens"].shape[0] % mbs == 0
            assert c["loss"] == pytest.approx(_expected_loss(c["batch"], mode), abs=1e-6)
    if epochs == 2:
        assert orders[0] != orders[1]  # each epoch reshuffles
    assert out["grad_norm"] == pytest.approx(sum(1.0 + i for i in range(len(calls))) / len(calls))
    assert out["guard/skipped_updates"] == 0.0
    assert (out["calib/low"], out["calib/high"]) == pytest.approx((0.8, 1.2))  # 1 -/+ eps_clip(_high)
    # the logged pg_loss: every update's numerator over every update's count, all epochs together
    counts = [_count(c["batch"], mode) for c in calls]
    logged = sum(_expected_loss(c["batch"], mode) * n for c, n in zip(calls, counts)) / sum(counts)
    assert out["pg_loss"] == pytest.approx(logged, abs=1e-6) and out["loss"] == pytest.approx(logged, abs=1e-6)
    assert out["noise/log_ratio_std_at_old"] == 0.0 and out["log_ratio/mean"] == 0.0


def _by_prompt(batch, tokenizer) -> dict[str, list[float]]:
    """prompt digits -> the per-row advantage of its trained rows, in sample order."""
    out: dict[str, list[float]] = {}
    mask = batch["loss_mask"]
    for row in range(batch["tokens"].shape[0]):
        if mask[row].sum() == 0:
            continue
        text = tokenizer.decode(batch["tokens"][row], skip_special_tokens=True)
        prompt = text.split("=")[0]
        out.setdefault(prompt, []).append(float((batch["advantages"][row] * mask[row]).sum() / mask[row].sum()))
    return out


def test_generate_metrics_are_over_every_response_of_groups_of_different_rewards_and_lengths():
    run = toy_run(rewards=RUNNER, cfg=_cfg("rollout.n_samples_per_prompt=4", "data.prompts_per_step=3"))
    rollout = phases.generate(run, prompts(run.tokenizer, ["1100", "2222", "0123"]), step=0)
    rewards = [1, 1, 0, 0, 2, 2, 2, 2, 0, 1, 2, 3]
    mean = sum(rewards) / 12
    m = rollout.metrics
    assert m["reward/mean"] == pytest.approx(mean) and m["reward/accuracy"] == pytest.approx(mean)
    assert m["reward/std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rewards) / 12))
    assert m["response_length/mean"] == pytest.approx(2.5) and m["response_length/max"] == 4.0
    assert m["response_length/clip_ratio"] == pytest.approx(3 / 12)  # the 4-token responses hit max_new_tokens
    # sort's format: 3..6 digits; responses of length 3 and 4 pass
    assert m["health/garbled_rate"] == pytest.approx(6 / 12)
    assert (m["reward/errors"], m["reward/overlong_penalty"], m["step/skipped"]) == (0.0, 0.0, 0.0)
    assert "dapo/gen_batches" not in m and m["dynamic_sampling/kept_frac"] == 1.0
    adv = _by_prompt(rollout.batch, run.tokenizer)
    for g in ("1100", "2222", "0123"):
        assert adv[g] == pytest.approx(_grpo([float(c) for c in g]), abs=1e-5)


def test_refill_trains_the_first_kept_groups_of_each_round_up_to_the_target():
    # round 0 keeps one informative group of 3; round 1 keeps three, of which two reach the target
    run = toy_run(rewards=RUNNER, cfg=_cfg("rollout.n_samples_per_prompt=3", "data.prompts_per_step=3",
                                           "algo.dynamic_sampling=true", "algo.max_gen_batches=4",
                                           "train.num_mini_batches=1", "train.micro_batch_size=4"))
    run.loader.batches = [prompts(run.tokenizer, ["201", "030", "102"], start=3)]
    rollout = phases.generate(run, prompts(run.tokenizer, ["000", "120", "333"]), step=5)
    metrics = dict(rollout.metrics)
    batch = phases.prepare(run, rollout.batch, 5, metrics)
    phases.update_policy(run, batch, 5)
    m = rollout.metrics
    assert (m["dapo/gen_batches"], m["dapo/kept_groups"], m["dapo/kept_fraction"]) == (2.0, 3.0, 1.0)
    assert m["dynamic_sampling/kept_frac"] == pytest.approx(12 / 18)  # 1 + 3 informative groups of 6, before trimming
    all_rewards = [0, 0, 0, 1, 2, 0, 3, 3, 3, 2, 0, 1, 0, 3, 0, 1, 0, 2]  # the kept ones alone average 1.0
    mean = sum(all_rewards) / 18
    assert m["reward/mean"] == pytest.approx(mean)  # every response of both rounds
    assert m["reward/std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in all_rewards) / 18))
    adv = _by_prompt(batch, run.tokenizer)
    assert sorted(adv) == ["030", "120", "201"]  # "102" was kept too, but the target was reached
    for g in adv:
        assert adv[g] == pytest.approx(_grpo([float(c) for c in g]), abs=1e-5)
    assert batch["tokens"].shape[0] == 9  # no filler on one rank: most == taken
    (call,) = run.actor.calls
    assert sorted(_row_keys(call["batch"])) == sorted(_row_keys(batch))  # the optimizer sees those rows only
    seeds = [s.seed for _, s in run.engine.calls]
    assert len(seeds) == 2 and seeds[0] != seeds[1]


def test_a_round_that_keeps_more_than_needed_fills_the_target_and_no_more():
    run = toy_run(rewards=RUNNER, cfg=_cfg("rollout.n_samples_per_prompt=2", "data.prompts_per_step=2",
                                           "algo.dynamic_sampling=true"))
    rollout = phases.generate(run, prompts(run.tokenizer, ["10", "01"]), step=0)  # both informative
    assert rollout.metrics["dapo/gen_batches"] == 1.0 and rollout.metrics["dapo/kept_fraction"] == 1.0
    assert sorted(_by_prompt(rollout.batch, run.tokenizer)) == ["01", "10"]


@pytest.mark.parametrize("rows, parts, sizes", [(10, 4, [3, 3, 2, 2]), (3, 4, [1, 1, 1]), (1, 2, [1]), (8, 1, [8])])
def test_mini_batches_are_near_equal_and_never_empty(rows, parts, sizes):
    batch = {"tokens": torch.arange(rows)[:, None], "loss_mask": torch.ones(rows, 1)}
    got = mini_batches(batch, parts, torch.Generator().manual_seed(0))
    assert [len(p["tokens"]) for p in got] == sizes
    assert sorted(int(t) for p in got for t in p["tokens"].flatten()) == list(range(rows))


def test_non_finite_old_log_probs_count_on_response_tokens_only():
    run = toy_run(rewards=RUNNER, cfg=_cfg())
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    old = torch.zeros(2, 4)
    old[0, 0] = float("nan")  # a prompt position: not counted
    old[0, 1] = float("inf")
    old[1, 2] = float("-inf")
    ref = torch.zeros(2, 4)
    ref[1, 3] = float("nan")
    ref[1, 0] = float("nan")  # prompt again
    batch = {"loss_mask": mask, "old_logprobs": old, "ref_logprobs": ref}
    assert phases._count_nonfinite(run, batch) == 3.0


def _advantages_reference(groups: list[list[float]], lengths: list[list[int]], estimator: str) -> list[float]:
    """Per sample, by the formulas of docs/algo.md, over the groups that are trained."""
    out = []
    if estimator == "reinforce_plus_plus_baseline":  # group mean off, then whitened over every token
        centred = [r - sum(g) / len(g) for g in groups for r in g]
        counts = [float(n) for ls in lengths for n in ls]
        total = sum(counts)
        mu = sum(n * c for n, c in zip(counts, centred)) / total
        var = (sum(n * c * c for n, c in zip(counts, centred)) - total * mu * mu) / (total - 1)
        return [(c - mu) / math.sqrt(max(var, 0.0) + 1e-8) for c in centred]
    for g in groups:
        n, mean = len(g), sum(g) / len(g)
        if estimator == "grpo":
            out += _grpo(g)
        elif estimator == "dr_grpo":
            out += [r - mean for r in g]
        else:  # rloo
            out += [r - (sum(g) - r) / (n - 1) for r in g]
    return out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text("0123", min_size=3, max_size=3), min_size=4, max_size=4),
       st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]), st.booleans(),
       st.sampled_from([(0, 1.0), (2, 1.0), (4, 0.5)]))
def test_advantages_of_the_trained_rows_for_every_estimator_x_dynamic_sampling_x_overlong(groups, estimator, dapo,
                                                                                         overlong):
    buffer, factor = overlong
    run = toy_run(rewards=RUNNER, cfg=_cfg(
        "rollout.n_samples_per_prompt=3", "data.prompts_per_step=4", f"algo.advantage_estimator={estimator}",
        f"algo.dynamic_sampling={str(dapo).lower()}", "algo.max_gen_batches=1", f"algo.overlong_buffer_len={buffer}",
        f"algo.overlong_penalty_factor={factor}"))
    rollout = phases.generate(run, prompts(run.tokenizer, groups), step=0)
    lengths = [1, 2, 3]  # the scripted engine's, sample j has j + 1 tokens; max_new_tokens = 4

    def shaped(digit: str, length: int) -> float:
        if not buffer:
            return float(digit)
        return float(digit) - min(max(length - (4 - buffer), 0), buffer) / buffer * factor

    rewards = [[shaped(d, n) for d, n in zip(g, lengths)] for g in groups]
    kept = [i for i, r in enumerate(rewards) if not dapo or len(set(r)) > 1]
    m = rollout.metrics
    assert m["reward/overlong_penalty"] == pytest.approx(sum(sum(r) for r in rewards) / 12
                                                         - sum(int(d) for g in groups for d in g) / 12, abs=1e-6)
    if not kept:
        assert rollout.batch is None and m["step/skipped"] == 1.0
        return
    batch = rollout.batch
    mask = batch["loss_mask"]
    assert batch["tokens"].shape[0] == 3 * len(kept)
    got = ((batch["advantages"] * mask).sum(1) / mask.sum(1)).tolist()
    expected = _advantages_reference([rewards[i] for i in kept], [lengths] * len(kept), estimator)
    assert got == pytest.approx(expected, abs=1e-4)
    if dapo:
        assert m["dapo/kept_groups"] == len(kept) and m["dapo/kept_fraction"] == len(kept) / 4


def _stale_loss(mb, forced: bool, shift: float, tis: bool = False) -> float:
    """Token-mean PPO loss of a mini-batch whose old log-probs sit `shift` above the trainer's (and the
    rollout's): r = exp(-shift) everywhere, or exactly 1 where the ratio is forced; with TIS, times
    w = pi_old / pi_rollout capped at 2 (exp(shift), or 1 where forced: pi_old is the forward's own)."""
    r = 1.0 if forced else math.exp(-shift)
    w = min(math.exp(shift), 2.0) if tis and not forced else 1.0
    mask, adv = mb["loss_mask"], mb["advantages"]
    per_token = torch.where(adv >= 0, -r * adv, -torch.maximum(torch.tensor(r), torch.tensor(0.8)) * adv)
    return float((w * per_token * mask).sum() / mask.sum())


@pytest.mark.parametrize("epochs, num_mb, tis", [(2, 2, False), (3, 1, False), (2, 2, True)])
def test_a_forced_on_policy_ratio_is_used_by_the_first_update_of_the_step_only(epochs, num_mb, tis):
    """algo.force_on_policy_ratio: the first mini-batch of the FIRST epoch trains on r = 1; every
    later update (the next mini-batches, and the first mini-batch of later epochs) on pi / pi_old."""
    cfg = _cfg("rollout.n_samples_per_prompt=4", f"data.prompts_per_step={len(GROUPS)}", "algo.force_on_policy_ratio=true",
               f"train.num_mini_batches={num_mb}", f"train.ppo_epochs={epochs}", "train.micro_batch_size=8",
               "algo.loss_agg_mode=token-mean", f"algo.use_tis={str(tis).lower()}", "algo.tis_clip=2.0")
    run = toy_run(cfg, rewards=RUNNER)
    rollout = phases.generate(run, prompts(run.tokenizer, GROUPS), step=0)
    batch = phases.prepare(run, rollout.batch, 0, dict(rollout.metrics))
    shift = 0.5  # stale old log-probs: r = exp(-0.5) = 0.61, below L = 0.8
    batch["old_logprobs"] = batch["old_logprobs"] + shift
    phases.update_policy(run, batch, 0)
    calls = run.actor.calls
    assert len(calls) == epochs * num_mb
    for n, c in enumerate(calls):
        expected = _stale_loss(c["batch"], n == 0, shift, tis)
        assert c["loss"] == pytest.approx(expected, abs=1e-6), n
    # the first mini-batch of the second epoch is not forced (its forced loss would differ)
    assert _stale_loss(calls[num_mb]["batch"], True, shift, tis) != pytest.approx(calls[num_mb]["loss"], abs=1e-6)
