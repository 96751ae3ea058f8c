"""Config of the loss modes, sequence-level weights, rejection and sequence-level calibration:
valid recipes load, bad combinations fail at load naming the key."""

import pytest

from megatron_rl.config import load_config

FP8 = ["precision.train_recipe=blockwise"]
GSPO_CALIB = FP8 + ["algo.loss_mode=gspo", "algo.eps_clip=3e-4", "algo.eps_clip_high=4e-4", "calib.enabled=true",
                    "calib.level=sequence", "calib.log_ratio_range=0.01", "calib.low_min=0.99", "calib.high_max=1.01"]


@pytest.mark.parametrize("overrides", [
    ["algo.loss_mode=gspo", "algo.eps_clip=3e-4", "algo.eps_clip_high=4e-4", "algo.loss_agg_mode=seq-mean-token-mean"],
    ["algo.loss_mode=gspo_token", "algo.tis_level=sequence"],
    ["algo.loss_mode=cispo", "algo.eps_clip=1.0", "algo.eps_clip_high=4.0"],  # MiniMax: no lower bound
    ["algo.loss_mode=reinforce", "algo.use_tis=false"],
    ["algo.loss_mode=dro", "algo.dro_beta=0.1"],
    ["algo.rollout_rs=token_k1", "algo.rollout_rs_threshold=2.0", "algo.rollout_rs_threshold_low=0.5"],
    ["algo.advantage_estimator=reinforce_plus_plus_baseline"],
    GSPO_CALIB,
    # forcing the first of several mini-batches leaves the last one to calibrate
    FP8 + ["algo.force_on_policy_ratio=true", "train.num_mini_batches=2", "calib.enabled=true"],
    FP8 + ["algo.force_on_policy_ratio=true", "train.num_mini_batches=1", "train.ppo_epochs=2", "calib.diagnose=true"],
    FP8 + ["algo.old_logprob_precision=bf16", "calib.enabled=true"],
])
def test_recipes_load(overrides):
    load_config(None, overrides)


@pytest.mark.parametrize("overrides, key", [
    (["algo.loss_mode=ppo"], "algo.loss_mode"),
    (["algo.tis_level=seq"], "algo.tis_level"),
    (["algo.use_tis=false", "algo.tis_level=sequence"], "algo.tis_level"),
    (["algo.rollout_rs=seq_mean_k3"], "algo.rollout_rs"),
    (["algo.rollout_rs_threshold=0"], "algo.rollout_rs_threshold"),
    (["algo.rollout_rs_threshold_low=3.0"], "algo.rollout_rs_threshold_low"),
    (["algo.loss_mode=dro", "algo.dro_beta=-1"], "algo.dro_beta"),
    (["algo.loss_mode=cispo", "algo.eps_clip_c=3.0"], "algo.eps_clip_c"),
    (["algo.eps_clip=1.0"], "algo.eps_clip"),  # >= 1 only for CISPO's weight
    (["algo.advantage_estimator=reinforce"], "algo.advantage_estimator"),
    (["algo.force_on_policy_ratio=true", "algo.use_rollout_logprobs=true"], "algo.force_on_policy_ratio"),
    (["algo.force_on_policy_ratio=true", "algo.rollout_rs=token_k1"], "algo.force_on_policy_ratio"),
    # one mini-batch, one epoch: the calibration mini-batch would be the forced one (ratio 1)
    (FP8 + ["algo.force_on_policy_ratio=true", "train.num_mini_batches=1", "calib.enabled=true"],
     "algo.force_on_policy_ratio"),
    (FP8 + ["algo.force_on_policy_ratio=true", "train.num_mini_batches=1", "calib.diagnose=true"],
     "algo.force_on_policy_ratio"),
    (["algo.old_logprob_precision=fp8"], "algo.old_logprob_precision"),
    (["algo.old_logprob_precision=bf16", "algo.use_rollout_logprobs=true"], "algo.old_logprob_precision"),
    (["calib.level=tokens"], "calib.level"),
    # GSPO clips sequence ratios: token-level calibration would match the wrong distribution
    (GSPO_CALIB + ["calib.level=token"], "calib.level"),
    (FP8 + ["calib.enabled=true", "calib.level=sequence"], "calib.level"),
    (FP8 + ["calib.diagnose=true", "algo.loss_mode=cispo"], "calib.enabled"),
    # the default histogram (bins of 0.002 in log r) cannot resolve GSPO's 3e-4 band
    (GSPO_CALIB + ["calib.log_ratio_range=2.0"], "calib.log_ratio_range"),
])
def test_bad_combinations_fail_at_load_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        load_config(None, overrides)
