"""LossSpec: policy_loss's knobs as one frozen object, checked when built; the loop builds it from `algo`."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.algo.loss_spec import LossSpec
from megatron_rl.config import load_config
from megatron_rl.loop.phases import loss_spec

# A non-default value for every knob the algo config feeds (LossSpec's defaults: vanilla, no TIS, k3, ...).
ALGO = {"eps_clip": 0.15, "eps_clip_high": 0.35, "eps_clip_c": 2.5, "loss_agg_mode": "seq-mean-token-sum",
        "use_tis": True, "tis_clip": 1.7, "tis_clip_low": 0.3, "tis_mode": "icepop", "tis_level": "sequence",
        "icepop_low": 0.4, "icepop_high": 3.0, "rollout_rs": "token_k1", "rollout_rs_threshold": 1.9,
        "rollout_rs_threshold_low": 0.6, "dro_beta": 0.3, "kl_loss_type": "k2", "kl_loss_coef": 0.02,
        "entropy_coef": 0.004, "loss_mode": "gspo_token"}


def test_the_loop_builds_the_spec_from_every_algo_knob_and_the_bounds_in_force():
    cfg = load_config(None, [f"algo.{k}={v}" for k, v in ALGO.items()])
    spec = loss_spec(cfg.algo, (0.7, 1.6))  # e.g. calibrated (L, H), not 1 -/+ eps
    want = {k: v for k, v in ALGO.items() if k not in ("eps_clip", "eps_clip_high")}
    want.update(clip_low=0.7, clip_high=1.6, ref_clip_low=0.85, ref_clip_high=1.35)  # reference: 1 -/+ eps
    want["force_on_policy_ratio"] = False  # per mini-batch, the loop's `forced` (the test below)
    got = dataclasses.asdict(spec)
    assert set(got) == set(want)  # no knob of the spec left at its default by the loop
    assert got == pytest.approx(want)
    for name, field in ((f.name, f) for f in dataclasses.fields(LossSpec)):
        if field.default is not dataclasses.MISSING and name != "force_on_policy_ratio":
            assert got[name] != field.default, name  # each value above differs from the spec's default


def test_the_loop_forces_the_ratio_only_on_the_mini_batch_it_names():
    cfg = load_config(None, ["algo.force_on_policy_ratio=true"])
    assert loss_spec(cfg.algo, (0.8, 1.2), forced=True).force_on_policy_ratio
    assert not loss_spec(cfg.algo, (0.8, 1.2)).force_on_policy_ratio  # later mini-batches


def test_a_spec_is_frozen():
    spec = LossSpec(clip_low=0.8, clip_high=1.2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.use_tis = True
    assert spec == LossSpec(clip_low=0.8, clip_high=1.2) and hash(spec) == hash(LossSpec(clip_low=0.8, clip_high=1.2))


@pytest.mark.parametrize("knobs, match", [
    (dict(clip_low=1.2, clip_high=1.2), "clip_low < clip_high"),
    (dict(clip_low=-0.1, clip_high=1.2), "clip_low"),
    (dict(eps_clip_c=1.0), "eps_clip_c"),
    (dict(loss_mode="reinforce", eps_clip_c=3.0), "eps_clip_c"),
    (dict(loss_mode="ppo"), "loss_mode"),
    (dict(loss_agg_mode="sum"), "loss_agg_mode"),
    (dict(kl_loss_type="k5"), "kl_loss_type"),
    (dict(rollout_rs="seq_k1"), "rollout_rs"),
])
def test_a_bad_knob_is_refused_when_the_spec_is_built(knobs, match):
    with pytest.raises(ValueError, match=match):
        LossSpec(**{"clip_low": 0.8, "clip_high": 1.2, **knobs})
