"""The loop on 2 real gloo processes: what each rank computes and what it receives.

DP=2: each rank rolls out its own shard of the global prompt batch, scores its own responses and
computes its own groups' advantages (checked on the rank against the reward function and a slow
GRPO reference); metrics are global means, identical on both ranks; after every step both ranks
hold the same weights, the same clip-controller state, and engines that serve exactly those weights.
TP=2 (same launch): only the engine rank samples; its peer receives the samples and trains on
exactly the same batch, with the same rewards, metrics and bounds.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from loop_trace import check_sample_flow, trace_run  # noqa: E402

PER_RANK = ("time/", "sync/seconds", "sync/gb_per_s")  # wall-clock metrics differ by rank


def _recording_waits(mp) -> tuple[list, Callable]:
    """Every object broadcast and barrier of the run, with its group named against the run's own
    groups (`setup` of trace_run captures them): the gloo twins "mp" / "dp" / "world" of the host
    groups, the trainer's own "trainer mp" / "trainer dp", "default" (None) or "other"."""
    from megatron_rl import collectives

    waits, groups = [], {}

    def name(group):
        if group is None:
            return "default"
        return next((k for k, g in groups.items() if g is group), "other")

    def setup(run_):
        h, p = run_.host_groups, run_.parallel
        groups.update({"mp": h.mp, "dp": h.dp, "world": h.world, "trainer mp": p.mp_group, "trainer dp": p.dp_group})

    real_broadcast, real_barrier = collectives.broadcast_object, collectives.barrier

    def broadcast_object(obj, src, group):
        waits.append(("broadcast", name(group)))
        return real_broadcast(obj, src, group)

    def barrier(group):
        waits.append(("barrier", name(group)))
        real_barrier(group)
    mp.setattr(collectives, "broadcast_object", broadcast_object)
    mp.setattr(collectives, "barrier", barrier)
    return waits, setup


def _dp_part(log_dir: str) -> list[dict]:
    with pytest.MonkeyPatch.context() as mp:
        waits, setup = _recording_waits(mp)
        trace = trace_run(Path(log_dir), "fp8_calibrated.yaml", "train.num_steps=2", "calib.period=1",
                          "train.lr=3e-3", setup=setup)
    out = []
    for step in trace.steps:
        (prompts,), (generate,) = step.of("prompts"), step.of("generate")
        out.append({
            "rewards": check_sample_flow(trace, step),  # this rank's own responses, rewards, advantages
            "global_prompts": prompts.data["prompt_ids"], "prompts": generate.data["prompt_ids"],
            "metrics": {k: v for k, v in step.metrics.items() if not k.startswith(PER_RANK)},
            **{k: step.state[k] for k in ("controller", "params", "engine_sums", "trainer_sums", "loader")},
        })
    out[-1]["waits"] = waits
    return out


def _tp_part(log_dir: str) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        waits, setup = _recording_waits(mp)
        trace = trace_run(Path(log_dir), "fp8_calibrated.yaml", "train.num_steps=1", "train.lr=3e-3",
                          "parallel.tensor_model_parallel_size=2", setup=setup)
    (step,) = trace.steps
    if step.of("generate"):
        check_sample_flow(trace, step)
    return {"waits": waits,
            "num_generate": len(step.of("generate")), "train": [e.data["batch"] for e in step.of("train")],
            "num_score": len(step.of("score")),
            "metrics": {k: v for k, v in step.metrics.items() if not k.startswith(PER_RANK)},
            **{k: step.state[k] for k in ("controller", "engine_sums", "trainer_sums")}}


def _refill_part(log_dir: str) -> list[dict]:
    """DP=2 DAPO refill: the task's exact-match reward drops groups, so rounds are refilled."""
    trace = trace_run(Path(log_dir), "dapo_fp8_calibrated.yaml", "train.num_steps=2", "reward.name=",
                      "algo.max_gen_batches=0")
    return [{"metrics": {k: v for k, v in step.metrics.items() if not k.startswith(PER_RANK)},
             "rounds": len(step.of("generate")), "params": step.state["params"], "loader": step.state["loader"],
             "rows": sum(e.data["batch"]["tokens"].shape[0] for e in step.of("train")),
             "trained": sum(int((e.data["batch"]["loss_mask"].sum(-1) > 0).sum()) for e in step.of("train"))}
            for step in trace.steps]


def _worker(rank: int, world_size: int, log_dir: str) -> dict:
    from megatron.core import parallel_state

    from megatron_rl.actor import parallel

    # Keep the gloo world between the two traces (a second rendezvous on the launcher's port
    # hangs); only Megatron's groups are rebuilt, for the other layout.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel, "destroy_parallel", parallel_state.destroy_model_parallel)
        return {"dp": _dp_part(log_dir + "/dp"), "tp": _tp_part(log_dir + "/tp"),
                "refill": _refill_part(log_dir + "/refill")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    log_dir = tmp_path_factory.mktemp("loop2")  # both traces share one warm-started tiny model
    return run_distributed(_worker, world_size=2, args=(str(log_dir),), timeout_s=180)


def test_dp_ranks_shard_prompts_score_their_own_and_agree_on_the_rest(ranks):
    for r0, r1 in zip(ranks[0]["dp"], ranks[1]["dp"]):
        batch = r0["global_prompts"]
        assert r1["global_prompts"] == batch and r0["loader"] == r1["loader"]
        half = len(batch) // 2
        assert (r0["prompts"], r1["prompts"]) == (batch[:half], batch[half:])
        assert _same(r0["metrics"], r1["metrics"]), "metrics must be global reductions"
        rewards = r0["rewards"] + r1["rewards"]
        mean = sum(rewards) / len(rewards)
        assert r0["metrics"]["reward/mean"] == pytest.approx(mean, rel=1e-6)  # float32 rewards
        std = math.sqrt(max(sum(x * x for x in rewards) / len(rewards) - mean * mean, 0.0))
        assert r0["metrics"]["reward/std"] == pytest.approx(std, rel=1e-5)
        assert r0["rewards"] != r1["rewards"]  # different prompts: a reused reward list would show
        assert (r0["controller"], r0["params"]) == (r1["controller"], r1["params"])
        assert r0["engine_sums"] == r0["trainer_sums"] == r1["engine_sums"]


def test_tp_peer_receives_the_engine_ranks_samples_and_trains_the_same_batch(ranks):
    t0, t1 = ranks[0]["tp"], ranks[1]["tp"]
    assert (t0["num_generate"], t1["num_generate"]) == (1, 0)  # one engine per model replica
    assert t1["engine_sums"] is None and t0["engine_sums"] == t0["trainer_sums"] == t1["trainer_sums"]
    assert (t0["num_score"], t1["num_score"]) == (1, 0)  # scored once per replica, then broadcast
    assert len(t0["train"]) == len(t1["train"]) > 0
    for b0, b1 in zip(t0["train"], t1["train"]):
        assert b0.keys() == b1.keys()
        for key in b0:
            assert torch.equal(b0[key], b1[key]), key
    # sync/* describes what the engine rank sent; everything else is the replica's, identical
    m0, m1 = ({k: v for k, v in t["metrics"].items() if not k.startswith("sync/")} for t in (t0, t1))
    assert _same(m0, m1), {k: (m0.get(k), m1.get(k)) for k in m0.keys() | m1.keys() if m0.get(k) != m1.get(k)}
    assert t0["controller"] == t1["controller"]


def test_the_long_waits_run_on_the_gloo_twins(ranks):
    """The rollout's waits (samples and rewards broadcast to a TP peer; replicas meeting after their
    rollouts) run on the host groups' gloo twins: NCCL's watchdog would abort a long rollout."""
    def phases(waits):  # the build's and the checkpoint's waits are on the default group or their own
        return [w for w in waits if w[1] not in ("default", "other")]
    for rank in ranks:
        assert phases(rank["tp"]["waits"]) == [("broadcast", "mp"), ("barrier", "dp"), ("broadcast", "mp")]
        assert phases(rank["dp"][-1]["waits"]) == [("barrier", "dp")] * 2  # one rollout round per step


def test_dp_refill_trains_exactly_prompts_per_step_groups_over_both_ranks(ranks):
    n, per_step = 4, 4  # TINY: rollout.n_samples_per_prompt, data.prompts_per_step
    for r0, r1 in zip(ranks[0]["refill"], ranks[1]["refill"]):
        assert _same(r0["metrics"], r1["metrics"]) and r0["loader"] == r1["loader"]
        assert r0["rounds"] == r1["rounds"] == r0["metrics"]["dapo/gen_batches"]  # both ranks sample every round
        assert r0["metrics"]["dapo/kept_groups"] == per_step
        # the kept groups are split over the ranks, padded to equal rows; their union is the batch
        assert r0["rows"] == r1["rows"] and r0["trained"] + r1["trained"] == per_step * n
        assert r0["params"] == r1["params"]
    assert any(r["metrics"]["dapo/gen_batches"] > 1 for r in ranks[0]["refill"]), "no refill: vacuous"
