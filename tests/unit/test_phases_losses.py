"""The loop phases' side of the loss modes: the knobs reach the loss, the denominator counts the
tokens the rejection mask keeps, and sequence-level calibration feeds one entry per sequence."""

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.config import load_config
from megatron_rl.loop import phases
from megatron_rl.loop.build import build_controller

GSPO = ["precision.train_recipe=tensorwise", "calib.enabled=true", "algo.loss_mode=gspo", "algo.eps_clip=3e-4",
        "algo.eps_clip_high=4e-4", "calib.level=sequence", "calib.log_ratio_range=0.01", "calib.low_min=0.99",
        "calib.high_max=1.01"]


def _run(*overrides):
    cfg = load_config(None, list(overrides))
    return SimpleNamespace(cfg=cfg, controller=build_controller(cfg))


def _micro_batch():
    """Two sequences of 3 tokens at theta_old; the rollout disagrees on token (1, 2) by e^1."""
    old = torch.full((2, 3), -1.0)
    rollout = old.clone()
    rollout[1, 2] = 0.0  # k1 = +1 > log 2: rejected by token_k1 at threshold 2
    return old.clone(), {"old_logprobs": old, "advantages": torch.tensor([[1.0] * 3, [-1.0] * 3]),
                         "tokens": torch.zeros(2, 3, dtype=torch.long), "loss_mask": torch.ones(2, 3),
                         "rollout_logprobs": rollout, "ratio_ref": torch.ones(2, 3)}


def test_denominator_counts_the_kept_tokens():
    _, mb = _micro_batch()
    assert phases._denominator(_run(), mb, None) == 6.0
    assert phases._denominator(_run("algo.rollout_rs=token_k1"), mb, None) == 5.0
    assert phases._denominator(_run("algo.rollout_rs=token_k1", "algo.loss_agg_mode=seq-mean-token-mean"), mb,
                               None) == 2.0


def test_loss_mode_and_rejection_reach_the_loss():
    logprobs, mb = _micro_batch()
    run = _run("algo.loss_mode=cispo", "algo.rollout_rs=token_k1", "algo.use_tis=false")
    loss, metrics = phases._loss_fn(run, 5.0, (0.8, 1.2))(logprobs, None, mb)
    # CISPO at r = 1: -A log pi = -A * (-1) on the 5 kept tokens, sum (3 - 2) / 5
    assert loss.item() == pytest.approx((3 * 1.0 - 2 * 1.0) / 5)
    m = reduce_metrics([metrics])
    assert m["rollout_rs_masked_fraction"] == 1 / 6 and "cispo_clipfrac" in m


def test_sequence_calibration_histogram_has_one_entry_per_sequence():
    logprobs, mb = _micro_batch()
    run = _run(*GSPO)
    _, metrics = phases._loss_fn(run, 2.0, run.controller.bounds, calibrating=True)(logprobs, None, mb)
    hist = run.controller.new_histogram()
    hist.merge(metrics.pop(phases.HIST_KEY))
    # entries are sequences, weighted by the sum of their tokens' loss weights (token-mean, TIS on)
    assert hist.scalar("tokens") == 2.0 and hist.scalar("neg_tokens") == 1.0 and hist.scalar("pos") == 3.0
    assert hist.scalar("neg") == pytest.approx(2.0 + math.exp(-1.0))
    assert "seq_log_ratio/mean" in reduce_metrics([metrics])


@pytest.mark.parametrize("overrides, knobs", [
    (["algo.use_tis=true", "algo.tis_mode=truncate", "algo.tis_clip=1.5", "algo.tis_clip_low=0.6",
      "algo.eps_clip_c=2.5", "algo.kl_loss_type=k2", "algo.kl_loss_coef=0.3", "algo.entropy_coef=0.01"],
     dict(use_tis=True, tis_mode="truncate", tis_clip=1.5, tis_clip_low=0.6, eps_clip_c=2.5, kl_loss_type="k2",
          kl_loss_coef=0.3, entropy_coef=0.01)),
    (["algo.use_tis=true", "algo.tis_mode=icepop", "algo.icepop_low=0.7", "algo.icepop_high=1.3"],
     dict(use_tis=True, tis_mode="icepop", icepop_low=0.7, icepop_high=1.3)),
    (["algo.use_tis=true", "algo.tis_level=sequence", "algo.tis_clip=1.2"],
     dict(use_tis=True, tis_level="sequence", tis_clip=1.2)),
    (["algo.loss_mode=dro", "algo.dro_beta=0.4", "algo.loss_agg_mode=seq-mean-token-sum", "algo.use_tis=false"],
     dict(loss_mode="dro", dro_beta=0.4, loss_agg_mode="seq-mean-token-sum")),
])
def test_every_loss_knob_of_the_config_reaches_the_loss(overrides, knobs):
    """The phase's loss equals policy_loss called with the knobs written out here (non-default values)."""
    from megatron_rl.algo.policy_loss import policy_loss

    run = _run("calib.enabled=false", "algo.eps_clip=0.25", "algo.eps_clip_high=0.3", *overrides)
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 5, generator=g) - 0.5
    logprobs = old + 0.4 * torch.randn(3, 5, generator=g)
    mb = {"old_logprobs": old, "advantages": torch.tensor([[1.0] * 5, [-1.0] * 5, [0.5] * 5]),
          "tokens": torch.zeros(3, 5, dtype=torch.long), "loss_mask": torch.ones(3, 5),
          "rollout_logprobs": old + 0.3 * torch.randn(3, 5, generator=g), "ref_logprobs": old - 0.2,
          "ratio_ref": torch.exp(logprobs - old + 0.05)}
    mb["rollout_logprobs"][0, 0] = old[0, 0] + 0.6  # TIS weight e^-0.6 = 0.55: under 0.6 and 0.7, over 0.5
    mb["ratio_ref"][1, 0], mb["ratio_ref"][0, 1] = 0.72, 1.35  # between the BF16 bounds and the FP8 ones
    entropy = torch.rand(3, 5, generator=g)
    loss, metrics = phases._loss_fn(run, 15.0, (0.7, 1.4))(logprobs, entropy, mb)
    want, want_metrics = policy_loss(
        logprobs, old, mb["advantages"], mb["loss_mask"], denominator=15.0, clip_low=0.7, clip_high=1.4,
        rollout_logprobs=mb["rollout_logprobs"], ref_logprobs=mb["ref_logprobs"], entropy=entropy,
        ratio_ref=mb["ratio_ref"], ref_clip_low=0.75, ref_clip_high=1.3, **knobs)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert reduce_metrics([metrics]) == pytest.approx(reduce_metrics([want_metrics]), rel=1e-6, nan_ok=True)
    # each knob matters on this batch: left at its default (the BF16 reference bounds: at the FP8
    # bounds in force, policy_loss's fallback), it gives another loss or other metrics
    written = dict(knobs, ref_clip_low=0.75, ref_clip_high=1.3)
    defaults = inspect.signature(policy_loss).parameters
    for name in [k for k, v in written.items() if v != defaults[k].default]:
        rest = {k: v for k, v in written.items() if k != name}
        other, other_metrics = policy_loss(
            logprobs, old, mb["advantages"], mb["loss_mask"], denominator=15.0, clip_low=0.7, clip_high=1.4,
            rollout_logprobs=mb["rollout_logprobs"], ref_logprobs=mb["ref_logprobs"], entropy=entropy,
            ratio_ref=mb["ratio_ref"], **rest)
        assert (float(other) != pytest.approx(float(want), rel=1e-6)
                or reduce_metrics([other_metrics]) != pytest.approx(reduce_metrics([want_metrics]), rel=1e-6,
                                                                    nan_ok=True)), name


def test_the_loss_clips_at_the_calibrated_bounds_only_when_calibration_is_on():
    on = _run("precision.train_recipe=tensorwise", "calib.enabled=true", "algo.eps_clip=0.2", "algo.eps_clip_high=0.28")
    on.controller.load_state_dict({"low": 0.7, "high": 1.5, "num_calibrations": 1, "num_skipped": 0})
    assert phases._bounds(on) == (0.7, 1.5)
    off = _run("calib.enabled=false", "algo.eps_clip=0.2", "algo.eps_clip_high=0.28")
    off.controller.load_state_dict({"low": 0.7, "high": 1.5, "num_calibrations": 1, "num_skipped": 0})
    assert phases._bounds(off) == pytest.approx((0.8, 1.28))  # diagnose only: the bounds are not applied
    cispo = _run("calib.enabled=false", "algo.loss_mode=cispo", "algo.eps_clip=1.0", "algo.eps_clip_high=4.0")
    assert phases._bounds(cispo) == (0.0, 5.0)  # no lower bound on CISPO's weight
