"""The reference model: KL-regularised GRPO on the tiny pipeline (KL in the loss and in the reward),
one reference forward per step, KL 0 while the policy is the reference, a resume that rebuilds it."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.telemetry.logger import read_jsonl
from test_rl_loop import EXAMPLES, TINY, _initial_weights, run_tiny

KL = ("algo.kl_loss_coef=0.05", "algo.kl_reward_coef=0.01", "train.lr=3e-3", "checkpoint.save_final=true")


def test_kl_grpo_trains_with_one_reference_forward_per_step(tmp_path, monkeypatch):
    from megatron_rl.actor.actor import MegatronActor

    calls = []
    real = MegatronActor.compute_logprobs

    def counting(self, batch, **kw):
        calls.append(self.optimizer is None)  # True: the frozen reference
        return real(self, batch, **kw)

    monkeypatch.setattr(MegatronActor, "compute_logprobs", counting)
    records = run_tiny(tmp_path, "bf16.yaml", "train.num_steps=5", *KL)
    assert [r["step/skipped"] for r in records] == [0.0] * 5
    assert calls.count(True) == 5  # once per step, after the old log-probs
    for r in records:
        for key in ("kl/ref_mean", "kl_loss", "kl/reward_penalty", "loss", "pg_loss", "grad_norm", "entropy"):
            assert r.get(key) is not None and math.isfinite(r[key]), (r["step"], key)
        # token-mean: loss = pg_loss + kl_loss_coef * kl_loss (no entropy term)
        assert r["loss"] - r["pg_loss"] == pytest.approx(0.05 * r["kl_loss"], rel=1e-4, abs=1e-9)
    # step 0 samples from the initial weights: the old policy is the reference, bitwise (BF16 both)
    assert records[0]["kl/ref_mean"] == 0.0 and records[0]["kl/reward_penalty"] == 0.0
    assert all(r["kl/ref_mean"] > 0 for r in records[1:])  # k3 >= 0, > 0 once the policy moved
    assert all(r["kl/reward_penalty"] != 0 for r in records[1:])

    # a resume rebuilds the reference from the initial weights, not from the checkpoint
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.loop import build

    cfg = load_config(EXAMPLES / "bf16.yaml", [*TINY, f"log.dir={tmp_path / 'run'}", "train.num_steps=6",
                                                "checkpoint.resume=true", *KL])
    run_ = build.build_run(cfg)
    try:
        assert run_.resume_step() == 5
        initial = _initial_weights(tmp_path)
        ref, actor = dict(run_.ref.export_hf_weights()), dict(run_.actor.export_hf_weights())
        assert all(torch.equal(ref[n], initial[n].to(ref[n].dtype)) for n in ref)
        assert any(not torch.equal(actor[n], ref[n]) for n in ref)
    finally:
        run_.finish()
        destroy_parallel()


def test_a_reference_without_initial_weights_is_refused_at_load(tmp_path):
    with pytest.raises(ValueError, match="model.hf_dir"):
        load_config(None, ["algo.kl_loss_coef=0.01", f"model.hf_dir={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match="algo.kl_reward_coef"):
        load_config(None, ["algo.kl_reward_coef=-0.1"])
    load_config(None, [f"model.hf_dir={tmp_path / 'missing'}"])  # no KL: no reference, no check here


def test_ref_precision_train_matches_the_old_logprobs_and_bf16_does_not(tmp_path):
    """FP8 recipe: the reference in the training recipe computes exactly the old log-probs at step 0
    (same weights, same pass); in BF16 it differs from them by the FP8 error."""
    one = ("train.num_steps=1", "algo.kl_loss_coef=0.01", "calib.period=100")
    (train,) = run_tiny(tmp_path, "fp8_calibrated.yaml", *one, "algo.ref_precision=train")
    # the same tiny-model cache (tmp_path), another log folder
    run_tiny(tmp_path, "fp8_calibrated.yaml", *one, "algo.ref_precision=bf16", f"log.dir={tmp_path / 'b'}")
    (bf16,) = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert train["kl/ref_mean"] == 0.0
    assert bf16["kl/ref_mean"] > 0.0


def test_kl_in_the_reward_shifts_each_response_by_its_summed_k1_before_grpo(tmp_path):
    """verl's use_kl_in_reward, by hand: A = GRPO(reward - coef * sum_t (log pi_old - log pi_ref))."""
    from loop_trace import _grpo

    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.loop import build, phases

    coef = 0.5
    cfg = load_config(EXAMPLES / "bf16.yaml", [*TINY, f"log.dir={tmp_path / 'run'}", f"algo.kl_reward_coef={coef}"])
    run_ = build.build_run(cfg)
    try:
        run_.sync.sync()
        batch = phases.generate(run_, run_.loader.next_batch(), 0).batch
        rewards = batch["rewards"].tolist()
        with torch.no_grad():  # move the policy away from the reference, so the penalty is not 0
            for p in run_.actor.model[0].parameters():
                p.add_(0.01 * torch.randn_like(p))
        metrics: dict = {}
        batch = phases.prepare(run_, batch, 1, metrics)
        mask = batch["loss_mask"]
        k1 = ((batch["old_logprobs"] - batch["ref_logprobs"]) * mask).sum(-1).tolist()
        shaped = [r - coef * k for r, k in zip(rewards, k1)]
        expected = _grpo(shaped, cfg.rollout.n_samples_per_prompt)
        got = [float(batch["advantages"][i][mask[i] > 0][0]) for i in range(len(expected))]
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)
        assert expected != pytest.approx(_grpo(rewards, cfg.rollout.n_samples_per_prompt), abs=1e-3)
        assert metrics["kl/reward_penalty"] == pytest.approx(coef * sum(k1) / len(k1), rel=1e-5)
        assert "rewards" not in batch
    finally:
        run_.finish()
        destroy_parallel()
