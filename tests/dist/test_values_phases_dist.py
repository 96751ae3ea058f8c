"""loop/phases.py's decisions across 2 real gloo DP ranks where the trigger reaches ONE rank: in the
first generation round only rank 1 holds informative groups (both ranks must still sample a second
round, and agree on what each trains); rank 0 then trains fewer groups and pads with masked rows;
every update's loss is divided by the count over BOTH ranks; the rollout metrics are over both
ranks' responses, the longest response the maximum (not the sum) of the two; calibrated bounds one
ulp apart on one rank of a model-parallel group stop every rank of it. The scripted engine
and toy actor are tests/doubles/toy_phase_run.py; expected values are by hand."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))

# Global prompts per round (digits = the group's rewards); rank r shards prompts [2r, 2r + 2).
ROUND0 = ["000", "111", "120", "201"]  # rank 0: nothing informative; rank 1: two groups
ROUND1 = ["012", "444", "300", "021"]  # rank 0: one; rank 1: two (only one needed)
RPP = ["120", "201", "300", "111"]  # REINFORCE++ with a sample dump: whitened over both ranks' tokens


def _worker(rank: int, world_size: int, log_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_rl import collectives
    from megatron_rl.config import load_config
    from megatron_rl.loop import phases
    import math
    from types import SimpleNamespace

    from toy_phase_run import prompts, toy_parallel, toy_run

    dist.init_process_group("gloo")
    cfg = load_config(None, ["calib.enabled=false", "rollout.max_new_tokens=4", "rollout.n_samples_per_prompt=3",
                             "data.prompts_per_step=4", "algo.dynamic_sampling=true", "train.num_mini_batches=1",
                             "train.micro_batch_size=2"])
    run = toy_run(cfg, toy_parallel(rank, world_size, lambda t: collectives.all_reduce(t, None)))
    run.engine.short = rank == 1  # rank 1's responses are one token: the longest is rank 0's
    run.loader.batches = [prompts(run.tokenizer, ROUND1, start=4)]
    try:
        rollout = phases.generate(run, prompts(run.tokenizer, ROUND0), step=1)
        metrics = dict(rollout.metrics)
        batch = phases.prepare(run, rollout.batch, 1, metrics)
        out = phases.update_policy(run, batch, 1)
    finally:
        run.rewards.close()
    (call,) = run.actor.calls
    rows = [run.tokenizer.decode(t, skip_special_tokens=True) for t, m in zip(batch["tokens"], batch["loss_mask"])
            if m.sum() > 0]
    result = {"metrics": rollout.metrics, "rows": rows, "num_rows": int(batch["tokens"].shape[0]),
              "adv_sum": float((batch["advantages"] * batch["loss_mask"]).sum()),
              "tokens": float(batch["loss_mask"].sum()),
              "loss": call["loss"], "pg_loss": out["pg_loss"], "rounds": len(run.engine.calls)}
    # Every rank takes part in the dump's REINFORCE++ whitening (an all-reduce); the log rank writes it.
    cfg = load_config(None, ["calib.enabled=false", "rollout.max_new_tokens=4", "rollout.n_samples_per_prompt=3",
                             "data.prompts_per_step=4", "algo.advantage_estimator=reinforce_plus_plus_baseline",
                             "log.dump_samples_every=1", "log.dump_samples_num=100", f"log.dir={log_dir}"])
    run = toy_run(cfg, toy_parallel(rank, world_size, lambda t: collectives.all_reduce(t, None)))
    run.engine.short = rank == 1
    try:
        rollout = phases.generate(run, prompts(run.tokenizer, RPP), step=1)
    finally:
        run.rewards.close()
    mask = rollout.batch["loss_mask"]
    result["rpp"] = ((rollout.batch["advantages"] * mask).sum(1) / mask.sum(1)).tolist()
    # (L, H) compared over a model-parallel group of the 2 ranks: one ulp off on rank 1 alone
    mp = SimpleNamespace(tp_size=2, pp_size=1, mp_group=None)
    verdicts = []
    for apart in (False, True):
        bounds = (0.8, math.nextafter(1.2, 2.0) if apart and rank == 1 else 1.2)
        try:
            phases.assert_same_across_model_parallel(bounds, mp)
            verdicts.append("same")
        except RuntimeError as err:
            verdicts.append(str(err))
    result["bounds"] = verdicts
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("phases_dist")
    return run_distributed(_worker, 2, args=(str(log_dir),), timeout_s=180), log_dir


def test_a_round_informative_on_one_rank_only_makes_both_ranks_sample_again(ranks):
    ranks, _ = ranks
    assert [r["rounds"] for r in ranks] == [2, 2]
    for r in ranks:
        m = r["metrics"]
        assert (m["dapo/gen_batches"], m["dapo/kept_groups"], m["dapo/kept_fraction"]) == (2.0, 4.0, 1.0)
        assert m["step/skipped"] == 0.0


def test_each_rank_trains_its_share_of_the_plan_and_pads_to_the_most(ranks):
    ranks, _ = ranks
    # (round, rank) order up to 4 groups: round 0 rank 1 takes "120", "201"; round 1 rank 0 takes
    # "012", rank 1 takes "300" (its "021" is beyond the target). Rank 1 trains 3 groups, rank 0 one.
    prompts = [sorted({row.split("=")[0] for row in r["rows"]}) for r in ranks]
    assert prompts == [["012"], ["120", "201", "300"]]
    assert [r["num_rows"] for r in ranks] == [9, 9]  # rank 0: one group and two masked filler groups
    assert [len(r["rows"]) for r in ranks] == [3, 9]


def test_the_loss_of_each_rank_is_over_both_ranks_tokens(ranks):
    ranks, _ = ranks
    total = sum(r["tokens"] for r in ranks)
    for r in ranks:
        assert r["loss"] == pytest.approx(-r["adv_sum"] / total, abs=1e-6)  # at ratio 1: -A per token
    both = -sum(r["adv_sum"] for r in ranks) / total
    assert ranks[0]["pg_loss"] == ranks[1]["pg_loss"] == pytest.approx(both, abs=1e-6)


def test_rollout_metrics_are_over_both_ranks_responses(ranks):
    ranks, _ = ranks
    rewards = [int(c) for g in ROUND0 + ROUND1 for c in g]  # every response of both rounds, both ranks
    mean = sum(rewards) / len(rewards)
    lengths = [j + 1 for _ in range(4) for j in range(3)] + [1] * 12  # rank 0: 1..3, rank 1: 1
    for r in ranks:
        m = r["metrics"]
        assert m["reward/mean"] == pytest.approx(mean)
        assert m["reward/std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)))
        assert m["response_length/mean"] == pytest.approx(sum(lengths) / 24)
        assert m["response_length/max"] == 3.0
        assert m["dynamic_sampling/kept_frac"] == pytest.approx(5 * 3 / 24)  # 5 informative groups of 8


def _rpp_reference() -> list[list[float]]:
    """REINFORCE++ by hand: c = reward - group mean; mean and unbiased variance of c over every
    response token of both ranks (rank 0's responses are 1..3 tokens long, rank 1's one token)."""
    centred, counts = [], []
    for rank, groups in ((0, RPP[:2]), (1, RPP[2:])):
        for g in groups:
            rewards = [float(c) for c in g]
            mean = sum(rewards) / 3
            centred += [r - mean for r in rewards]
            counts += [1.0] * 3 if rank == 1 else [1.0, 2.0, 3.0]
    count = sum(counts)
    mu = sum(n * c for n, c in zip(counts, centred)) / count
    var = (sum(n * c * c for n, c in zip(counts, centred)) - count * mu * mu) / (count - 1)
    out = [(c - mu) / math.sqrt(var + 1e-8) for c in centred]
    return [out[:6], out[6:]]


def test_the_dump_and_the_batch_whiten_over_both_ranks_and_only_rank_0_writes(ranks):
    ranks, log_dir = ranks
    expected = _rpp_reference()
    for rank, r in enumerate(ranks):
        assert r["rpp"] == pytest.approx(expected[rank], abs=1e-5)
    (dump,) = sorted((log_dir / "samples").iterdir())
    assert dump.name == "step_000001.jsonl"
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [r["response"] for r in records] == ["1", "22", "000", "2", "00", "111"]  # rank 0's shard
    assert [r["advantage"] for r in records] == pytest.approx(expected[0], abs=1e-5)


def test_bounds_one_ulp_apart_on_one_rank_fail_every_rank_of_the_replica(ranks):
    ranks, _ = ranks
    for r in ranks:
        assert r["bounds"][0] == "same"
        assert r["bounds"][1].startswith("calibrated (L, H) differ across the model-parallel group")
