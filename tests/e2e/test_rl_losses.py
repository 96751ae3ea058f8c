"""Tiny FP8 runs with the other loss modes: GSPO with sequence-level Calibrated Clipping and
sequence TIS, CISPO with TIS, REINFORCE++ with baseline and the rejection mask; 5 steps each."""

from __future__ import annotations

from test_rl_loop import _finite, run_tiny

LOSS_KEYS = ("reward/mean", "loss", "pg_loss", "grad_norm", "entropy", "ppo_kl")


def test_gspo_with_sequence_calibration_trains_five_steps(tmp_path):
    records = run_tiny(tmp_path, "gspo_fp8_calibrated.yaml", "train.num_steps=5", "calib.alpha_tolerance_tokens=0")
    trained = [r for r in records if not r["step/skipped"]]
    assert len(trained) >= 4
    _finite(trained, LOSS_KEYS + ("seq_log_ratio/mean", "calib/low", "calib/high", "tis_clipfrac"))
    # calibrated on steps 0, 2, 4 (period 2), in sequences, and the bounds stay in the GSPO band's range
    calibrated = [r for r in records if "calib/tokens" in r and not r.get("calib/skipped", 1.0)]
    assert calibrated and all(0 < r["calib/tokens"] <= 16 for r in calibrated)  # 4 prompts x 4 samples
    assert all(0.99 <= r["calib/low"] <= 1.0 <= r["calib/high"] <= 1.01 for r in trained)


def test_cispo_with_tis_trains_five_steps(tmp_path):
    records = run_tiny(tmp_path, "fp8.yaml", "train.num_steps=5", "algo.loss_mode=cispo", "algo.eps_clip=1.0",
                       "algo.eps_clip_high=0.28", "algo.use_tis=true", "calib.diagnose=false")
    trained = [r for r in records if not r["step/skipped"]]
    assert len(trained) >= 4
    _finite(trained, LOSS_KEYS + ("cispo_clipfrac", "tis_clipfrac"))
    assert all(r["pg_clipfrac"] == 0.0 for r in trained)  # CISPO zeroes no token's gradient


def test_reinforce_baseline_with_rejection_trains_five_steps(tmp_path):
    records = run_tiny(tmp_path, "fp8.yaml", "train.num_steps=5",
                       "algo.advantage_estimator=reinforce_plus_plus_baseline", "algo.rollout_rs=token_k1",
                       "algo.rollout_rs_threshold=1.5")
    trained = [r for r in records if not r["step/skipped"]]
    assert len(trained) >= 4
    _finite(trained, LOSS_KEYS + ("rollout_rs_masked_fraction", "tis_clipfrac"))
    assert all(0.0 <= r["rollout_rs_masked_fraction"] < 0.5 for r in trained)
