"""DAPO refill on the tiny pipeline: each step trains exactly data.prompts_per_step informative
groups when the rounds allow, the data position counts every prompt consumed, a resume is exact,
and at the limit the step trains on what was kept (or fails, by algo.on_max_gen_batches)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.rewards import register_reward_fn
from test_rl_loop import run_tiny

# the task's exact-match reward: some groups all right or all wrong, so rounds 2+ happen
DAPO = ("reward.name=", "algo.max_gen_batches=0", "calib.period=3")


def _loader_state(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:06d}" / "rl_state.pt", weights_only=True)["loader"]


def _consumed(state: dict) -> int:
    return state["epoch"] * state["num_items"] + state["position"]


def test_refill_fills_the_batch_and_resumes_exactly(tmp_path):
    full = run_tiny(tmp_path / "a", "dapo_fp8_calibrated.yaml", "train.num_steps=4", *DAPO)
    per_step = 4  # TINY's data.prompts_per_step
    assert [r["dapo/kept_groups"] for r in full] == [per_step] * 4
    assert all(r["dapo/kept_fraction"] == 1.0 for r in full)
    assert any(r["dapo/gen_batches"] > 1 for r in full), "no step refilled: the test is vacuous"
    # the data position counts every prompt of every round
    run_tiny(tmp_path / "b", "dapo_fp8_calibrated.yaml", "train.num_steps=2", "checkpoint.save_every=2", *DAPO)
    consumed = sum(r["dapo/gen_batches"] for r in full[:2]) * per_step
    assert _consumed(_loader_state(tmp_path / "b" / "run", 2)) == consumed
    resumed = run_tiny(tmp_path / "b", "dapo_fp8_calibrated.yaml", "train.num_steps=4", "checkpoint.resume=true",
                       *DAPO)
    for key in ("dapo/gen_batches", "dapo/kept_groups", "dynamic_sampling/kept_frac", "reward/mean", "pg_loss",
                "grad_norm", "entropy"):
        assert [r.get(key) for r in resumed[2:]] == [r.get(key) for r in full[2:]], key


def _constant(response: str, answer: str) -> float:
    return 1.0


def test_the_limit_trains_on_what_was_kept_or_fails(tmp_path):
    register_reward_fn("test_refill_constant", _constant)
    limit = ("reward.name=test_refill_constant", "algo.overlong_buffer_len=0", "algo.max_gen_batches=3", "train.num_steps=1",
             "checkpoint.save_final=true")
    (record,) = run_tiny(tmp_path, "dapo_fp8_calibrated.yaml", *limit)
    assert (record["dapo/gen_batches"], record["dapo/kept_groups"], record["step/skipped"]) == (3, 0, 1.0)
    assert _consumed(_loader_state(tmp_path / "run", 1)) == 3 * 4
    with pytest.raises(RuntimeError, match="algo.on_max_gen_batches=fail"):  # same tiny-model cache
        run_tiny(tmp_path, "dapo_fp8_calibrated.yaml", *limit, "algo.on_max_gen_batches=fail",
                 f"log.dir={tmp_path / 'fail'}")
