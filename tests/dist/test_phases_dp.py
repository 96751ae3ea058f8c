"""One RL step's update on DP=2 (2 gloo processes) equals one process's on the union of the two
ranks' batches: the loss and every loss metric, the gradient norm, the reference KL and the
calibrated (L, H). Each rank has its own prompts, so a reduction that is skipped (a per-rank loss
denominator, a metric or a histogram left local) moves a number away from the one-process value.

The ranks' shards differ in size on purpose (rank 1's responses are cut shorter), so a mean of
per-rank means is not the global mean."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_rl_loop import EXAMPLES, TINY  # noqa: E402

SETTINGS = [*TINY, "train.sft_steps=0", "train.colocated_protocol=false", "model.tiny_num_layers=1",
            "train.num_mini_batches=1", "train.micro_batch_size=4", "calib.period=1", "algo.kl_loss_coef=0.1",
            "algo.kl_loss_type=k2", "algo.ref_precision=bf16", "train.lr=1e-2", "reward.name=test_phases_dp_varied"]
PER_RANK = ("time/",)
BATCH_KEYS = ("tokens", "loss_mask", "advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs")


def varied(response: str, answer: str) -> dict:
    """A score that differs between almost any two texts, twice that as a component, and a component
    that only rank 0's responses carry (the reward worker inherits its rank's environment)."""
    score = sum(map(ord, response)) % 7 / 7
    extra = {"only_rank0": 1.0} if os.environ.get("RANK") == "0" else {}
    return {"score": score, "twice": 2 * score, **extra}


# REINFORCE++ inputs per rank (one group of 4 each): rewards, response tokens per sample
RPP_SHARDS = [([1.0, 0.0, 0.5, 0.0], [3.0, 1.0, 2.0, 5.0]), ([0.0, 1.0, 1.0, 0.25], [2.0, 2.0, 0.0, 4.0])]


def _cfg(log_dir: str):
    from megatron_rl.config import load_config

    return load_config(EXAMPLES / "fp8_calibrated.yaml", [*SETTINGS, f"log.dir={log_dir}"])


def _worker(rank: int, world_size: int, log_dir: str) -> dict:
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.loop import build, phases
    from megatron_rl.rewards import register_reward_fn

    register_reward_fn("test_phases_dp_varied", varied)
    run = build.build_run(_cfg(log_dir))
    try:
        run.sync.sync()
        rollout = phases.generate(run, run.loader.next_batch(), 0)
        metrics = dict(rollout.metrics)
        batch = phases.prepare(run, rollout.batch, 0, metrics)
        prepared = {k: batch[k].clone() for k in BATCH_KEYS}  # what the reference KL was measured on
        if rank == 1:  # a smaller shard: only the first response token of each row counts
            first = batch["loss_mask"].cumsum(-1) <= 1
            batch["loss_mask"] = batch["loss_mask"] * first
            batch["advantages"] = batch["advantages"] * batch["loss_mask"]
        before = {k: batch[k].clone() for k in BATCH_KEYS}
        metrics.update(phases.update_policy(run, batch, 0))
        # a second update of the same batch: its first mini-batch is no longer at theta_old, so the
        # noise/* and shadow/* metrics (first and calibration mini-batch) are non-zero, and per rank
        second = phases.update_policy(run, batch, 1)
        second = {k: v for k, v in second.items() if k.startswith(("noise/", "shadow/"))}
        run.cfg.algo.advantage_estimator = "reinforce_plus_plus_baseline"  # whitened over both ranks' tokens
        rewards, counts = RPP_SHARDS[rank]
        rpp = phases._advantages(run, torch.tensor(rewards), torch.tensor(counts))
        return {"batch": before, "prepared": prepared, "metrics": {k: v for k, v in metrics.items() if not k.startswith(PER_RANK)},
                "dp_size": run.parallel.dp_size, "rpp": rpp, "second": second}
    finally:
        run.finish()
        destroy_parallel()


def _union(batches: list[dict]) -> dict:
    width = max(b["tokens"].shape[1] for b in batches)
    return {k: torch.cat([torch.nn.functional.pad(b[k], (0, width - b[k].shape[1])) for b in batches])
            for k in BATCH_KEYS}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, world_size=2, args=(str(tmp_path_factory.mktemp("dp2")),), timeout_s=240)


@pytest.fixture(scope="module")
def one_process(ranks, tmp_path_factory) -> dict:
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.loop import build, phases
    from megatron_rl.rewards import register_reward_fn

    register_reward_fn("test_phases_dp_varied", varied)
    run = build.build_run(_cfg(str(tmp_path_factory.mktemp("dp1"))))
    try:
        return phases.update_policy(run, _union([r["batch"] for r in ranks]), 0)
    finally:
        run.finish()
        destroy_parallel()


@pytest.mark.timeout(300)
def test_dp2_update_equals_one_process_on_the_union_of_the_batches(ranks, one_process):
    r0, r1 = ranks
    assert r0["dp_size"] == r1["dp_size"] == 2
    tokens = [float(r["batch"]["loss_mask"].sum()) for r in ranks]
    assert tokens[0] > 2 * tokens[1]  # uneven shards: a mean of per-rank means would differ
    for key in ("loss", "pg_loss", "entropy", "ppo_kl", "grad_norm", "clip/low_neg", "clip/high_pos",
                "log_ratio/std", "calib/low", "calib/high", "calib/tokens", "shadow/clip_low_neg_bf16"):
        assert r0["metrics"][key] == r1["metrics"][key], key
        assert r0["metrics"][key] == pytest.approx(one_process[key], rel=1e-4, abs=1e-7), key
    assert r0["metrics"]["calib/num_calibrations"] == 1.0


@pytest.mark.timeout(300)
def test_dp2_reference_and_rollout_metrics_are_over_both_ranks(ranks):
    r0, r1 = ranks
    union = _union([r["prepared"] for r in ranks])
    on = union["loss_mask"] > 0
    d = (union["ref_logprobs"] - union["old_logprobs"])[on]
    expected = float((0.5 * d.square()).double().mean())  # k2 over every response token of both ranks
    assert expected > 0
    # reward components: means over both ranks; a name one rank lacks counts 0 there
    assert r0["metrics"]["reward/twice"] == pytest.approx(2 * r0["metrics"]["reward/mean"], rel=1e-6)
    assert r0["metrics"]["reward/only_rank0"] == r1["metrics"]["reward/only_rank0"] == 0.5  # equal shards of rows
    for key in ("kl/ref_mean", "reward/mean", "reward/twice", "reward/std", "response_length/mean", "response_length/max",
                "health/garbled_rate", "guard/nonfinite_logprobs"):
        assert r0["metrics"][key] == r1["metrics"][key], key
    assert r0["metrics"]["kl/ref_mean"] == pytest.approx(expected, rel=1e-4)
    lengths = union["loss_mask"].sum(-1)
    assert r0["metrics"]["response_length/mean"] == pytest.approx(float(lengths.mean()), rel=1e-6)
    assert r0["metrics"]["response_length/max"] == float(lengths.max())


def test_dp2_reinforce_plus_plus_whitens_over_both_ranks_tokens(ranks):
    """Group-centred rewards whitened by the mean and unbiased variance over every response token of
    both ranks, by hand; a rank whitening its own shard would give other values."""
    centred, tokens = [], []
    for rewards, counts in RPP_SHARDS:
        mean = sum(rewards) / len(rewards)
        centred += [r - mean for r in rewards]
        tokens += [r - mean for r, c in zip(rewards, counts) for _ in range(int(c))]
    mu = sum(tokens) / len(tokens)
    var = sum((t - mu) ** 2 for t in tokens) / (len(tokens) - 1)
    expected = torch.tensor([(c - mu) / (var + 1e-8) ** 0.5 for c in centred])
    torch.testing.assert_close(torch.cat([r["rpp"] for r in ranks]), expected)


def test_dp2_first_and_calibration_mini_batch_metrics_are_over_both_ranks(ranks):
    r0, r1 = (r["second"] for r in ranks)
    assert r0.keys() == r1.keys() and {"noise/log_ratio_std_at_old", "shadow/log_ratio_fp8_std"} <= r0.keys()
    assert r0["noise/log_ratio_std_at_old"] > 0 and r0["shadow/log_ratio_fp8_std"] > 0  # not vacuous
    for key in r0:
        assert r0[key] == r1[key], key
