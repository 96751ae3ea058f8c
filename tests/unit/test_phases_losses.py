"""The loop phases' side of the loss modes: the knobs reach the loss, the denominator counts the
tokens the rejection mask keeps, and sequence-level calibration feeds one entry per sequence."""

import dataclasses
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
    from megatron_rl.algo.policy_loss import LossSpec, policy_loss

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
        logprobs, old, mb["advantages"], mb["loss_mask"],
        LossSpec(clip_low=0.7, clip_high=1.4, ref_clip_low=0.75, ref_clip_high=1.3, **knobs), denominator=15.0,
        rollout_logprobs=mb["rollout_logprobs"], ref_logprobs=mb["ref_logprobs"], entropy=entropy,
        ratio_ref=mb["ratio_ref"])
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert reduce_metrics([metrics]) == pytest.approx(reduce_metrics([want_metrics]), rel=1e-6, nan_ok=True)
    # each knob matters on this batch: left at its default (the BF16 reference bounds: at the FP8
    # bounds in force, policy_loss's fallback), it gives another loss or other metrics
    written = dict(knobs, ref_clip_low=0.75, ref_clip_high=1.3)
    defaults = {f.name: f for f in dataclasses.fields(LossSpec)}
    for name in [k for k, v in written.items() if v != defaults[k].default]:
        rest = {k: v for k, v in written.items() if k != name}
        other, other_metrics = policy_loss(
            logprobs, old, mb["advantages"], mb["loss_mask"], LossSpec(clip_low=0.7, clip_high=1.4, **rest),
            denominator=15.0, rollout_logprobs=mb["rollout_logprobs"], ref_logprobs=mb["ref_logprobs"],
            entropy=entropy, ratio_ref=mb["ratio_ref"])
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


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("overrides, knobs", [
    (["algo.use_tis=true", "algo.tis_mode=truncate", "algo.tis_clip=1.1", "algo.tis_clip_low=0.6",
      "algo.eps_clip_c=1.5", "algo.loss_agg_mode=seq-mean-token-mean"],
     dict(use_tis=True, tis_clip=1.1, tis_clip_low=0.6, eps_clip_c=1.5, loss_agg_mode="seq-mean-token-mean")),
    (["algo.use_tis=true", "algo.tis_mode=icepop", "algo.icepop_low=0.7", "algo.icepop_high=1.3"],
     dict(use_tis=True, mode="icepop", icepop_low=0.7, icepop_high=1.3)),
    (["algo.use_tis=true", "algo.tis_level=geo_mean", "algo.tis_clip=1.05", "algo.rollout_rs=token_k1",
      "algo.rollout_rs_threshold=1.5"],
     dict(use_tis=True, level="geo_mean", tis_clip=1.05, rollout_rs="token_k1", rollout_rs_threshold=1.5)),
])
def test_the_calibration_histogram_weighs_each_token_as_the_loss_does(overrides, knobs, level):
    """The phase's histogram equals one built by hand with the knobs written out (non-default
    values), on a micro-batch with padding; each knob, left at its default, gives another histogram."""
    from megatron_rl.algo.policy_loss import LOG_RATIO_CLAMP, loss_mask, loss_token_weights

    gspo = ["algo.loss_mode=gspo"] if level == "sequence" else []  # the sequence ratio's loss
    run = _run("precision.train_recipe=tensorwise", "calib.enabled=true", f"calib.level={level}", *gspo,
               "algo.eps_clip=0.25", "algo.eps_clip_high=0.3", *overrides)
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(4, 6, generator=g) - 0.5
    logprobs = old + 0.3 * torch.randn(4, 6, generator=g)
    logprobs[1] = old[1] + 0.6  # A < 0 at ratio e^0.6 = 1.8 > eps_clip_c: dual-clipped (token and sequence)
    mask = torch.ones(4, 6)
    mask[1, 4:], mask[3, 2:] = 0.0, 0.0  # padding: its log-probs are whatever the forward gave,
    logprobs[3, 4:] = old[3, 4:]  # here and there the old ones (the 0 of a padded row in both)
    rollout = old + 0.4 * torch.randn(4, 6, generator=g)
    rollout[0, 0] = old[0, 0] + 0.6  # weight e^-0.6 = 0.55: under 0.6 and 0.7, over 0.5
    rollout[2, 1] = old[2, 1] - 0.45  # k1 = 0.45: over log 1.5, under log 2
    ratio_ref = torch.exp(logprobs - old + 0.05 * torch.randn(4, 6, generator=g)) * mask + (1 - mask)
    adv = torch.tensor([1.0, -1.0, -0.5, 0.7])[:, None].expand(4, 6) * mask
    mb = {"old_logprobs": old, "advantages": adv, "tokens": torch.zeros(4, 6, dtype=torch.long), "loss_mask": mask,
          "rollout_logprobs": rollout, "ratio_ref": ratio_ref}
    _, metrics = phases._loss_fn(run, 24.0, (0.7, 1.4), calibrating=True)(logprobs, None, mb)
    got = metrics[phases.HIST_KEY]

    def by_hand(**written):
        rs = {k: written.pop(k) for k in ("rollout_rs", "rollout_rs_threshold") if k in written}
        agg = written.pop("loss_agg_mode", "token-mean")
        use_tis, dual_clip = written.pop("use_tis"), written.pop("eps_clip_c", None)
        weights = loss_token_weights(mask, agg, old, rollout, use_tis, **rs, **written)
        log_ratio = ((logprobs - old) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        hist = run.controller.new_histogram()
        if level == "sequence":
            hist.add_sequences(log_ratio, torch.log(ratio_ref), adv, loss_mask(mask, old, rollout, **rs),
                               weights=weights, dual_clip=dual_clip)
        else:
            hist.add(log_ratio.exp(), ratio_ref, adv, mask, weights=weights, dual_clip=dual_clip)
        return hist.payload

    torch.testing.assert_close(got, by_hand(**knobs))
    for name in [k for k in knobs if k != "use_tis"]:
        assert not torch.allclose(got, by_hand(**{k: v for k, v in knobs.items() if k != name})), name
