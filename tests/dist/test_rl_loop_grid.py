"""The loop on 4 real gloo processes, TP=2 x DP=2: rank mapping that 2 ranks cannot show.

With 2 processes every group is [0, 1], so a group rank equals the global rank and a broadcast from
the wrong source passes. Here Megatron's order (tp fastest) gives the TP groups [0, 1] and [2, 3]
and the DP groups [0, 2] and [1, 3]: each replica's engine rank (0 and 2) draws its own half of
the global batch, and its TP peer (1 and 3) must train on exactly that replica's samples and
rewards, not rank 0's.

DAPO dynamic sampling on the same grid: each rank trains its replica's kept groups and pads with
fully masked rows up to the other replica's count. Replaying the replicas' samples into one
process (TP = DP = 1), which drops the rows instead, must give the same metrics and weights.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from loop_trace import check_sample_flow, trace_run  # noqa: E402

from megatron_rl.rollout.base import Sample  # noqa: E402

PER_RANK = ("time/", "sync/", "memory/")  # wall clock; sync/* describes what the engine rank sent
GRID = ("parallel.tensor_model_parallel_size=2",)
# DAPO on the grid in BF16 (emulated FP8 scales differ between TP=2 shards and TP=1 at this tiny
# width: blocks of 128 do not align with 32-wide shards), at a low temperature so that many groups
# have equal rewards and are dropped: refill rounds, and replicas that keep unequal numbers of
# groups (measured: 5 and 3 of 8, over 2 rounds). One mini-batch: with several, each rank shuffles
# its own rows into mini-batches, so the partition (not the rows trained) differs from one process.
DAPO = ("train.num_steps=1", "train.num_mini_batches=1", "data.prompts_per_step=8", "rollout.temperature=0.2",
        "precision.train_recipe=bf16", "precision.rollout_quant=bf16", "calib.enabled=false",
        "reward.name=", "algo.max_gen_batches=8", *GRID)


def _samples(samples: list[Sample]) -> list[dict]:
    return [vars(s).copy() for s in samples]  # plain containers: the launcher's weights_only load


def _grid_part(log_dir: str) -> list[dict]:
    trace = trace_run(Path(log_dir), "fp8_calibrated.yaml", "train.num_steps=2", "calib.period=1", *GRID)
    out = []
    for step in trace.steps:
        (prompts,) = step.of("prompts")
        out.append({
            "rewards": check_sample_flow(trace, step) if step.of("generate") else None,
            "global_prompts": prompts.data["prompt_ids"],
            "generated": [e.data["prompt_ids"] for e in step.of("generate")],
            "num_score": len(step.of("score")),
            "train": [e.data["batch"] for e in step.of("train")],
            "metrics": {k: v for k, v in step.metrics.items() if not k.startswith(PER_RANK)},
            **{k: step.state[k] for k in ("controller", "params", "engine_sums", "trainer_sums", "loader")},
        })
    return out


def _dapo_part(log_dir: str) -> dict:
    trace = trace_run(Path(log_dir), "dapo_fp8_calibrated.yaml", *DAPO, weights=True)
    (step,) = trace.steps
    return {"rounds": [{"prompts": e.data["prompt_ids"], "samples": _samples(e.data["samples"])}
                       for e in step.of("generate")],
            "metrics": {k: v for k, v in step.metrics.items() if not k.startswith(PER_RANK)},
            "rows": [int(e.data["batch"]["tokens"].shape[0]) for e in step.of("train")],
            "trained": sum(int((e.data["batch"]["loss_mask"].sum(-1) > 0).sum()) for e in step.of("train")),
            "initial": trace.initial["weights"], "final": step.state["weights"]}


def _worker(rank: int, world_size: int, log_dir: str) -> dict:
    from megatron.core import parallel_state

    from megatron_rl.actor import parallel

    # One gloo world for both traces (a second rendezvous on the launcher's port hangs); only
    # Megatron's groups are rebuilt.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel, "destroy_parallel", parallel_state.destroy_model_parallel)
        return {"grid": _grid_part(log_dir + "/grid"), "dapo": _dapo_part(log_dir + "/dapo")}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("loop4")  # every trace shares one warm-started tiny model


@pytest.fixture(scope="module")
def ranks(root) -> list[dict]:
    return run_distributed(_worker, world_size=4, args=(str(root),), timeout_s=200)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def _equal_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) > 0 and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                        for x, y in zip(a, b))


@pytest.mark.timeout(300)
def test_each_replica_trains_its_own_samples_and_its_tp_peer_the_same(ranks):
    for step in zip(*(r["grid"] for r in ranks)):
        s0, s1, s2, s3 = step
        batch = s0["global_prompts"]
        assert all(s["global_prompts"] == batch and s["loader"] == s0["loader"] for s in step)
        half = len(batch) // 2
        # one engine per replica (its TP rank 0), each on its own DP shard; scored there only
        assert [s["generated"] for s in step] == [[batch[:half]], [], [batch[half:]], []]
        assert [s["num_score"] for s in step] == [1, 0, 1, 0]
        # the TP peer trains its own replica's batch (broadcast from rank 0 of its TP group, not
        # global rank 0): rank 3 must match rank 2 and differ from rank 0
        assert _equal_batches(s1["train"], s0["train"]) and _equal_batches(s3["train"], s2["train"])
        assert not torch.equal(s0["train"][0]["tokens"], s2["train"][0]["tokens"])
        rewards = s0["rewards"] + s2["rewards"]
        assert s0["rewards"] != s2["rewards"]
        assert s0["metrics"]["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
        assert all(_same(s["metrics"], s0["metrics"]) for s in step), "metrics are global reductions"
        assert all(s["controller"] == s0["controller"] for s in step)
        # the DP replicas hold the same shards; the two TP shards differ
        assert s0["params"] == s2["params"] and s1["params"] == s3["params"] != s0["params"]
        assert all(s["trainer_sums"] == s0["trainer_sums"] for s in step)
        assert s0["engine_sums"] == s2["engine_sums"] == s0["trainer_sums"]
        assert s1["engine_sums"] is None and s3["engine_sums"] is None


def _replay(rounds: list[list[Sample]]):
    """setup() for a one-process run: its engine hands out the given rounds in order."""
    def setup(run_):
        queue = list(rounds)

        def generate(prompts, sampling):
            samples = queue.pop(0)
            assert [s.prompt_ids for s in samples[::len(samples) // len(prompts)]] == prompts
            return samples
        run_.engine.generate = generate
    return setup


@pytest.mark.timeout(300)
def test_dp_dynamic_sampling_masks_what_one_process_drops(ranks, root):
    d0, d1, d2, d3 = (r["dapo"] for r in ranks)
    assert [len(d["rounds"]) for d in (d1, d3)] == [0, 0]
    assert len(d0["rounds"]) == len(d2["rounds"]) == d0["metrics"]["dapo/gen_batches"] > 1, "no refill: vacuous"
    n, per_step = 4, 8  # TINY: rollout.n_samples_per_prompt; DAPO: data.prompts_per_step
    # the replicas' kept groups are padded to as many rows; together they are prompts_per_step groups
    assert d0["metrics"]["dapo/kept_groups"] == per_step
    assert d0["rows"] == d2["rows"] and d0["trained"] + d2["trained"] == per_step * n
    assert d0["trained"] != d2["trained"], "both replicas kept as many groups: no masked padding to test"

    # One process, TP = DP = 1, drawing exactly the samples the two replicas drew, round by round
    rounds = [[Sample(**s) for s in a["samples"] + b["samples"]] for a, b in zip(d0["rounds"], d2["rounds"])]
    one = trace_run(root / "dapo_one", "dapo_fp8_calibrated.yaml", *DAPO[:-1], setup=_replay(rounds),
                    weights=True)
    (step,) = one.steps
    # the one process drops the rows instead of masking them: every row it trains is a kept one
    trained = [int((e.data["batch"]["loss_mask"].sum(-1) > 0).sum()) for e in step.of("train")]
    rows = [int(e.data["batch"]["tokens"].shape[0]) for e in step.of("train")]
    assert trained == rows and sum(rows) == d0["trained"] + d2["trained"]
    metrics = {k: v for k, v in step.metrics.items() if not k.startswith(PER_RANK)}
    assert metrics.keys() == d0["metrics"].keys()
    for key, value in metrics.items():
        assert d0["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key
    initial, final = one.initial["weights"], step.state["weights"]
    assert initial.keys() == d0["initial"].keys()
    lr = one.cfg.train.lr
    for name, start in initial.items():
        assert torch.equal(start, d0["initial"][name]), name  # the same warm start
        moved_one, moved_grid = final[name] - start, d0["final"][name] - start
        assert moved_one.abs().max() > 0.5 * lr, name  # an update happened
        # Adam's first step is about lr * sign(grad): a gradient entry near 0 may flip sign between
        # the reduction orders, so compare the update entry by entry within 5% of lr, but allow
        # at most 0.5% of the entries of a tensor to flip
        off = ((moved_one - moved_grid).abs() > 0.05 * lr).float().mean()
        assert off <= 0.005, (name, float(off))
