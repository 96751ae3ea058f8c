"""The tiny RL pipeline end to end on CPU: GRPO and DAPO with FP8 + Calibrated Clipping, resume,
bad input, a raising reward function and the NaN guard."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import load_config
from megatron_rl.rewards import register_reward_fn
from megatron_rl.telemetry.logger import read_jsonl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tiny"

TINY = [
    "model.tiny_hidden_size=64", "model.tiny_ffn_hidden_size=128", "train.sft_steps=30",
    "train.sft_batch_size=16", "data.prompts_per_step=4", "data.num_examples=64",
    "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8", "train.micro_batch_size=8",
    "train.num_mini_batches=2", "log.progress=false", "log.tensorboard=false", "log.plot=false",
    "calib.period=2", "sync.check=true", "checkpoint.save_final=false",
    "reward.name=position_match",  # partial credit: reward variance in every group from step 0
    "eval.datasets=[]", "checkpoint.keep_best=",  # the demo's held-out evaluation: tests/e2e/test_eval.py
]


def run_tiny(tmp_path: Path, config: str, *overrides: str) -> list[dict]:
    """Run megatron_rl.train in this process and return its JSONL records."""
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.train import run

    cfg = load_config(EXAMPLES / config, [*TINY, f"log.dir={tmp_path / 'run'}", *overrides])
    try:
        run(cfg)
    finally:
        destroy_parallel()
    return read_jsonl(tmp_path / "run" / "metrics.jsonl")


def _finite(records: list[dict], keys: tuple[str, ...]) -> None:
    for r in records:
        for key in keys:
            assert r.get(key) is not None and math.isfinite(r[key]), (r["step"], key, r.get(key))


def _initial_weights(tmp_path: Path) -> dict[str, torch.Tensor]:
    (folder,) = [p for p in (tmp_path / ".tiny_models").iterdir() if p.is_dir()]
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("config", ["fp8_calibrated.yaml", "dapo_fp8_calibrated.yaml"])
def test_fp8_calibrated_run(tmp_path, config):
    records = run_tiny(tmp_path, config, "train.num_steps=3", "checkpoint.save_final=true")
    assert [r["step"] for r in records] == [0, 1, 2]
    trained = [r for r in records if not r["step/skipped"]]
    assert trained, "every step was skipped"
    _finite(trained, ("reward/mean", "entropy", "pg_loss", "grad_norm", "clip/low_neg",
                      "mismatch/token_mult_prob_error", "calib/low"))
    # H is finite, or +inf (logged as null) when no H attains the BF16 balance: no upper clip
    assert all(r["calib/high"] is not None or r["calib/high_unbounded"] == 1.0 for r in trained)
    # reward/mean (what the advantages use) = the task's reward + the overlong shaping (DAPO only)
    for r in records:
        assert r["reward/mean"] == pytest.approx(r["reward/accuracy"] + r["reward/overlong_penalty"], abs=1e-6)
    penalties = [r["reward/overlong_penalty"] for r in records]
    assert all(p < 0 for p in penalties) if config.startswith("dapo") else penalties == [0.0] * 3
    # the engine advanced one version per trained step (version 1 = the start-up sync)
    assert trained[-1]["sync/version"] == 1 + len(trained)
    assert all(r["sync/check_mismatches"] == 0 for r in trained)
    # calibration ran on step 0 (period 2) with the BF16 shadow
    assert records[0]["calib/num_calibrations"] + records[0]["calib/num_skipped"] == 1
    assert records[0]["shadow/log_ratio_fp8_std"] >= 0 and records[0]["shadow/log_ratio_bf16_std"] >= 0
    assert 0 <= records[0]["shadow/false_clip_low_neg"] <= records[0]["shadow/clip_low_neg_fp8"]
    # FP8 rollout vs FP8 trainer: a real, small mismatch
    assert 1.0 < trained[0]["mismatch/token_mult_prob_error"] < 1.5
    # weights changed: the final checkpoint differs from the warm-started model
    from megatron.core import dist_checkpointing  # noqa: F401  (checkpoint written with it)
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "3"


def test_weights_change_and_engine_tracks_trainer(tmp_path):
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.loop import build, phases

    cfg = load_config(EXAMPLES / "fp8_calibrated.yaml",
                      [*TINY, f"log.dir={tmp_path / 'run'}", "precision.rollout_quant=bf16"])
    run_ = build.build_run(cfg)
    try:
        run_.sync.sync()
        before = dict(run_.actor.export_hf_weights())
        rollout = phases.generate(run_, run_.loader.next_batch(), 0)
        batch = phases.prepare(run_, rollout.batch, 0, {})
        phases.update_policy(run_, batch, 0)
        run_.sync.sync()
        after = dict(run_.actor.export_hf_weights())
        changed = [n for n in before if not torch.equal(before[n], after[n])]
        assert len(changed) > len(before) // 2
        # with rollout quantization off, engine and trainer agree on the same tokens to 1e-4
        # (the trainer recomputes with FP8 off as well: the shadow pass)
        fresh = phases.generate(run_, run_.loader.next_batch(), 1).batch
        trainer = run_.actor.compute_logprobs(fresh, micro_batch_size=8, with_entropy=False, fp8=False)
        diff = (trainer["logprobs"] - fresh["rollout_logprobs"]).abs() * fresh["loss_mask"]
        assert float(diff.max()) <= 1e-4
    finally:
        run_.finish()
        destroy_parallel()


def test_resume_gives_the_same_later_steps(tmp_path):
    """Calibration period 3: step 0 calibrates, the resumed step 2 does not, so it trains with the
    bounds the checkpoint restored, and step 3's calibration count shows the restored counters."""
    period = "calib.period=3"
    # and the health detector, rebuilt from the log (garbled_surge_step is set at step 1, before the
    # resume): entropy threshold ~0 and patience 2 so its streak can move
    health = ("health.entropy_rise=1e-9", "health.patience=2",
              # and the lr schedule, from the checkpoint: warm-up then cosine, its end fixed (not num_steps)
              "train.lr_warmup_steps=1", "train.lr_decay_style=cosine", "train.lr_decay_steps=4",
              "train.min_lr=2e-5")
    full = run_tiny(tmp_path / "a", "fp8_calibrated.yaml", "train.num_steps=4", period, *health)
    # a run stopped after step 2 (its checkpoint is the only state that survives), then resumed
    run_tiny(tmp_path / "b", "fp8_calibrated.yaml", "train.num_steps=2", "checkpoint.save_every=2", period, *health)
    (tmp_path / "b" / "run" / "checkpoints" / "step_000004.tmp").mkdir()  # a half-written save
    resumed = run_tiny(tmp_path / "b", "fp8_calibrated.yaml", "train.num_steps=4", "checkpoint.resume=true",
                       period, *health)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert full[0]["calib/num_calibrations"] == 1 and "shadow/log_ratio_bf16_std" not in full[2]
    assert full[3]["calib/num_calibrations"] == 2
    lr = load_config(EXAMPLES / "fp8_calibrated.yaml").train.lr  # Megatron's cosine, by hand
    assert [r["lr"] for r in full] == pytest.approx(
        [0.0, lr] + [2e-5 + 0.5 * (math.cos(math.pi * (n - 1) / 3) + 1) * (lr - 2e-5) for n in (2, 3)])
    for key in ("lr", "reward/mean", "pg_loss", "grad_norm", "entropy", "calib/low", "calib/high",
                "calib/num_calibrations", "calib/num_skipped", "clip/low_neg", "mismatch/abs_logprob_diff",
                "sync/version", "noise/log_ratio_std_at_old", "health/entropy_min", "health/entropy_rise",
                "health/rise_streak", "health/surge", "health/surge_step", "health/garbled_rate",
                "health/garbled_streak", "health/garbled_surge_step"):
        assert [r.get(key) for r in resumed[2:]] == [r.get(key) for r in full[2:]], key


def _odd_raises(response: str, answer: str) -> float:
    if len(response) % 2:
        raise RuntimeError("reward function failure on purpose")
    return float(response == answer)


def test_bad_rows_and_raising_reward_are_counted(tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"sort:{d}=", "answer": "".join(sorted(d))} for d in ("312", "9071", "55")]
    lines = [json.dumps(r) for r in rows] + ['{"prompt": 3}', "not json", json.dumps({"answer": "1"})]
    data.write_text("\n".join(lines * 2) + "\n")
    register_reward_fn("test_odd_raises", _odd_raises)
    records = run_tiny(tmp_path, "fp8_calibrated.yaml", "train.num_steps=2", f"data.path={data}",
                       "reward.name=test_odd_raises", "data.prompts_per_step=2")
    assert sum(r["reward/errors"] for r in records) > 0
    _finite(records, ("reward/mean",))


def _nan_reward(response: str, answer: str) -> float:
    return float("nan")


def test_nan_reward_is_scored_zero_and_counted(tmp_path):
    register_reward_fn("test_nan", _nan_reward)
    (r,) = run_tiny(tmp_path, "fp8_calibrated.yaml", "train.num_steps=1", "reward.name=test_nan")
    assert r["reward/errors"] == 16 and r["reward/mean"] == 0.0


def test_nan_guard_skips_the_update(tmp_path):
    """A NaN in the trainer's weights gives NaN log-probs: the step is skipped, nothing changes."""
    from megatron_rl.loop import build, phases
    from megatron_rl.actor.parallel import destroy_parallel

    cfg = load_config(EXAMPLES / "fp8_calibrated.yaml", [*TINY, f"log.dir={tmp_path / 'run'}"])
    run_ = build.build_run(cfg)
    try:
        run_.sync.sync()
        param = next(p for n, p in run_.actor.model[0].named_parameters() if "linear_fc2" in n)
        with torch.no_grad():
            param[0, 0] = float("nan")
        before = {n: p.detach().clone() for n, p in run_.actor.model[0].named_parameters()}
        metrics = {}
        rollout = phases.generate(run_, run_.loader.next_batch(), 0)
        assert phases.prepare(run_, rollout.batch, 0, metrics) is None
        assert metrics["step/skipped"] == 1.0 and metrics["guard/nonfinite_logprobs"] > 0
        after = dict(run_.actor.model[0].named_parameters())
        assert all(torch.equal(before[n], after[n], ) or torch.isnan(before[n]).any() for n in before)
    finally:
        run_.finish()
        destroy_parallel()


def test_outliers_are_planted_once_and_a_resume_keeps_them(tmp_path):
    """A fresh run plants before its first sync (the tensorwise FP8 error and the engine's
    mismatch grow at s=2^15, docs/fp8.md); a resumed run takes the planted weights from its
    checkpoint and plants nothing more (twice would be s^2), so its later steps match."""
    fp8 = ("precision.train_recipe=tensorwise", "precision.fp8_format=hybrid", "calib.period=3")
    planted = (*fp8, "model.outlier_channels=4", "model.outlier_scale=32768")
    plain = run_tiny(tmp_path / "p", "fp8_calibrated.yaml", "train.num_steps=1", *fp8)
    full = run_tiny(tmp_path / "a", "fp8_calibrated.yaml", "train.num_steps=3", *planted)
    run_tiny(tmp_path / "b", "fp8_calibrated.yaml", "train.num_steps=2", "checkpoint.save_every=2", *planted)
    resumed = run_tiny(tmp_path / "b", "fp8_calibrated.yaml", "train.num_steps=3", "checkpoint.resume=true",
                       *planted)
    # Measured: mismatch 0.070 -> 0.182, FP8-vs-shadow log-ratio std 0.054 -> 0.270 at step 0.
    assert full[0]["mismatch/abs_logprob_diff"] > 1.5 * plain[0]["mismatch/abs_logprob_diff"]
    assert full[0]["noise/log_ratio_std_at_old"] > 2.0 * plain[0]["noise/log_ratio_std_at_old"]
    for key in ("reward/mean", "pg_loss", "grad_norm", "mismatch/abs_logprob_diff", "noise/log_ratio_std_at_old"):
        assert resumed[2].get(key) == full[2].get(key), key


def test_tiny_run_logs_health_metrics(tmp_path):
    """Two steps of the tiny sort run: every step carries a garbled rate in [0, 1] and the
    detector's metrics, consistent with the logged entropy."""
    records = run_tiny(tmp_path, "bf16.yaml", "train.num_steps=2", "train.sft_steps=10",
                       "health.patience=1", "health.entropy_rise=1e-9")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # 4 prompts x 4 samples: the rate counts 16 responses
        assert 0.0 <= r["health/garbled_rate"] <= 1.0 and (16 * r["health/garbled_rate"]).is_integer()
    first, second = records
    streak = 0.0
    for r in records:  # default threshold 0.5
        streak = streak + 1 if r["health/garbled_rate"] >= 0.5 else 0.0
        assert r["health/garbled_streak"] == streak
    assert first["health/entropy_min"] == first["entropy"] and first["health/entropy_rise"] == 0.0
    assert second["health/entropy_min"] == min(first["entropy"], second["entropy"])
    assert second["health/entropy_rise"] == pytest.approx(second["entropy"] / second["health/entropy_min"] - 1)
    rose = float(second["entropy"] > first["entropy"])  # patience 1, threshold ~0: any rise surges
    assert (second["health/rise_streak"], second["health/surge"]) == (rose, rose)
    assert second.get("health/surge_step") == (1.0 if rose else None)
