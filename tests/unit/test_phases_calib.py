"""The loop phases' side of Calibrated Clipping: the loss it builds, the histogram it feeds, the old log-prob source."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.loop import phases
from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.loop.build import build_controller
from megatron_rl.config import load_config


def _run(*overrides):
    cfg = load_config(None, ["precision.train_recipe=tensorwise", "calib.enabled=true", *overrides])
    return SimpleNamespace(cfg=cfg, controller=build_controller(cfg))


def _micro_batch():
    """4 tokens: A>0 with ratios 1.4 (FP8 and BF16), A<0 with 0.7 / 1.0; the last row's token rejected by IcePop."""
    old = torch.zeros(2, 2)
    logprobs = torch.log(torch.tensor([[1.4, 1.4], [0.7, 1.0]]))
    return logprobs, {
        "old_logprobs": old, "advantages": torch.tensor([[1.0, 1.0], [-1.0, -1.0]]),
        "tokens": torch.zeros(2, 2, dtype=torch.long), "loss_mask": torch.ones(2, 2), "ratio_ref": logprobs.exp(),
        "rollout_logprobs": torch.tensor([[0.0, 0.0], [0.0, 3.0]]),  # w = exp(-3) < icepop_low on one token
    }


def test_bf16_upper_clip_metric_is_measured_at_one_plus_eps_high():
    run = _run("algo.eps_clip_high=0.2")
    logprobs, mb = _micro_batch()
    loss_fn = phases._loss_fn(run, denominator=4.0, bounds=(0.8, 1.6))  # calibrated H = 1.6
    _, metrics = loss_fn(logprobs, None, mb)
    reduced = reduce_metrics([metrics])
    assert reduced["clip/high_pos_ref"] == 1.0  # both A>0 tokens: 1.4 > 1.2 (at H it would be 0)
    assert reduced["clip/high_pos"] == 0.0


def test_calibration_histogram_weighs_tokens_like_the_loss():
    run = _run("algo.use_tis=true", "algo.tis_mode=icepop")
    logprobs, mb = _micro_batch()
    _, metrics = phases._loss_fn(run, 4.0, (0.8, 1.2), calibrating=True)(logprobs, None, mb)
    hist = run.controller.new_histogram()
    hist.merge(metrics[phases.HIST_KEY])
    # the IcePop-rejected A<0 token (ratio 1.0) is out; the one left is lower-clipped by BF16
    assert hist.scalar("neg_ref") == 1.0 and hist.scalar("neg_clip_ref") == 1.0
    assert hist.scalar("pos") == 2.0 and hist.scalar("pos_clip_ref") == 2.0
    # without the calibration flag the loss carries no histogram
    _, plain = phases._loss_fn(run, 4.0, (0.8, 1.2))(logprobs, None, mb)
    assert phases.HIST_KEY not in plain


@pytest.mark.parametrize("use_rollout", [True, False])
def test_both_ratios_share_the_old_log_prob_source(use_rollout):
    run = _run(f"algo.use_rollout_logprobs={str(use_rollout).lower()}")
    calls = []
    run.actor = SimpleNamespace(config=SimpleNamespace(sequence_parallel=False),
                                compute_logprobs=lambda b, **kw: calls.append(kw["fp8"]) or
                                {"logprobs": torch.full_like(b["old_logprobs"], -1.0)})
    run.cfg.train.micro_batch_size = 2
    _, mb = _micro_batch()
    phases._shadow_old(run, mb)
    if use_rollout:  # old log-probs are the rollout's: the BF16 ratio divides by them too, no pass
        assert mb["old_logprobs_ref"] is mb["old_logprobs"] and calls == []
    else:  # the trainer's: BF16 recompute at theta_old
        assert calls == [False] and torch.equal(mb["old_logprobs_ref"], torch.full((2, 2), -1.0))


def test_calib_config_keys_reach_the_controller_and_bad_values_name_the_key():
    ctrl = _run("calib.init_low=0.6", "calib.init_high=1.8", "calib.log_ratio_range=3.0",
                "calib.balance=abs_adv").controller
    assert ctrl.bounds == (0.6, 1.8) and ctrl.log_ratio_range == 3.0 and ctrl.rules.balance == "abs_adv"
    for override, key in [("calib.init_low=0.3", "calib.init_low"), ("calib.init_high=2.5", "calib.init_high"),
                          ("calib.low_min=0.9", "calib.low_min"), ("calib.high_max=1.1", "calib.high_max"),
                          ("calib.alpha_tolerance=1.5", "calib.alpha_tolerance"),
                          ("calib.log_ratio_range=0", "calib.log_ratio_range"), ("calib.balance=mass", "calib.balance")]:
        with pytest.raises(ValueError, match=key):
            _run(override)
