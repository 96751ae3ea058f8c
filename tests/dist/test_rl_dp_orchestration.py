"""The loop at DP=2 over 2 real gloo processes: what each rank computes and what it receives.

Each rank rolls out its own shard of the global prompt batch, scores its own responses and computes
its own groups' advantages (checked on the rank against the reward function and a slow GRPO
reference); metrics are global means, identical on both ranks; after every step both ranks hold
the same weights, the same clip-controller state, and engines that serve exactly those weights.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from loop_trace import check_sample_flow, trace_run  # noqa: E402

pytestmark = pytest.mark.timeout(600)
PER_RANK = ("time/", "sync/seconds", "sync/gb_per_s")  # wall-clock metrics differ by rank


def _dp_worker(rank: int, world_size: int, log_dir: str) -> list[dict]:
    trace = trace_run(Path(log_dir), "fp8_calibrated.yaml", "train.num_steps=2", "calib.period=1",
                      "train.lr=3e-3")
    out = []
    for step in trace.steps:
        (prompts,), (generate,) = step.of("prompts"), step.of("generate")
        out.append({
            "rewards": check_sample_flow(trace, step),  # this rank's own responses, rewards, advantages
            "global_prompts": prompts.data["prompt_ids"], "prompts": generate.data["prompt_ids"],
            "metrics": {k: v for k, v in step.metrics.items() if not k.startswith(PER_RANK)},
            **{k: step.state[k] for k in ("controller", "params", "engine_sums", "trainer_sums", "loader")},
        })
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def test_dp_ranks_shard_prompts_score_their_own_and_agree_on_the_rest(tmp_path):
    ranks = run_distributed(_dp_worker, world_size=2, args=(str(tmp_path / "run"),), timeout_s=600)
    for r0, r1 in zip(*ranks):
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
