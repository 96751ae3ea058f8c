"""force_on_policy_ratio (NeMo-RL's name; prime-rl's exact_on_policy_ratio): the loss takes its old
log-probs from the forward it is given, so the ratio it clips is exactly 1 and every A < 0 token
keeps its gradient. Expected values are worked out by hand from the inputs."""

import math

import pytest
import torch

from megatron_rl.algo.loss_spec import LossSpec
from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.algo.policy_loss import policy_loss

LOW, HIGH = 0.8, 1.2


def _inputs():
    """Two sequences of 3 tokens; the stale old log-probs put tokens at r = e^-0.5 (below L), e^0.5
    (above H) and 1; the rollout sits 0.1 nat below the current policy everywhere."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], requires_grad=True)
    old = logprobs.detach() - torch.tensor([[-0.5, 0.5, 0.0], [-0.5, 0.5, 0.0]])
    adv = torch.tensor([[-1.0] * 3, [2.0] * 3])
    rollout = logprobs.detach() - 0.1
    return logprobs, old, adv, torch.ones(2, 3), rollout


def _spec(forced: bool, **kw) -> LossSpec:
    return LossSpec(clip_low=LOW, clip_high=HIGH, force_on_policy_ratio=forced, **kw)


def test_forced_ratio_is_one_and_every_negative_token_keeps_its_gradient():
    logprobs, old, adv, mask, _ = _inputs()
    loss, metrics = policy_loss(logprobs, old, adv, mask, _spec(True), denominator=6.0)
    loss.backward()
    # r = 1 everywhere: loss = sum(-A) / 6 = (3 - 6) / 6; d loss / d logprob = -A r / 6 = -A / 6
    assert loss.item() == pytest.approx(-0.5, abs=1e-7)
    assert torch.equal(logprobs.grad, -adv / 6.0)
    m = reduce_metrics([metrics])
    assert m["log_ratio/std"] == 0.0 and m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0


def test_unforced_stale_ratio_zeroes_the_clipped_negative_token():
    """The same inputs without forcing: token (0, 0) has A < 0 and r = e^-0.5 < L, so its gradient
    is exactly zero (the failure the knob removes); token (1, 1) has A > 0, r = e^0.5 > H: zero too."""
    logprobs, old, adv, mask, _ = _inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask, _spec(False), denominator=6.0)
    loss.backward()
    g = logprobs.grad
    assert g[0, 0] == 0.0 and g[1, 1] == 0.0
    # unclipped tokens: -A r / 6; (0, 1): A = -1, r = e^0.5 (max(-A r, -A clip) takes the unclipped branch)
    assert g[0, 1].item() == pytest.approx(math.exp(0.5) / 6.0, rel=1e-6)
    assert g[1, 0].item() == pytest.approx(-2.0 * math.exp(-0.5) / 6.0, rel=1e-6)


def test_forced_loss_ignores_old_logprobs_and_accepts_none():
    logprobs, old, adv, mask, _ = _inputs()
    a, _ = policy_loss(logprobs, old, adv, mask, _spec(True), denominator=6.0)
    b, _ = policy_loss(logprobs, old + 5.0, adv, mask, _spec(True), denominator=6.0)
    c, _ = policy_loss(logprobs, None, adv, mask, _spec(True), denominator=6.0)
    assert a.item() == b.item() == c.item()
    with pytest.raises(ValueError, match="old_logprobs is None"):
        policy_loss(logprobs, None, adv, mask, _spec(False), denominator=6.0)


def test_forced_tis_weights_use_the_trainer_forward():
    """TIS weight min(exp(pi_old - pi_rollout), 2) with pi_old := this forward: exp(0.1) on every
    token, so the loss is exp(0.1) sum(-A) / 6, whatever the stale old log-probs say."""
    logprobs, old, adv, mask, rollout = _inputs()
    loss, metrics = policy_loss(logprobs, old, adv, mask, _spec(True, use_tis=True), denominator=6.0,
                                rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-0.5 * math.exp(0.1), rel=1e-6)
    assert reduce_metrics([metrics])["mismatch/abs_logprob_diff"] == pytest.approx(0.1, rel=1e-5)


@pytest.mark.parametrize("kw", [{"loss_mode": "gspo"}, {"eps_clip_c": 3.0}, {"loss_mode": "dro"}])
def test_forced_ratio_crossed_with_sequence_ratio_dual_clip_and_dro(kw):
    """GSPO's sequence ratio exp(mean log r) = 1, dual-clip never binds at r = 1, DRO's (log r)^2 = 0:
    all reduce to the on-policy gradient -A / 6 (GSPO / dual-clip) or -A / 6 (DRO: -(A log pi))."""
    logprobs, old, adv, mask, _ = _inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask, _spec(True, **kw), denominator=6.0)
    loss.backward()
    assert torch.allclose(logprobs.grad, -adv / 6.0, atol=1e-7)


def test_forced_spec_refuses_rejection_sampling():
    with pytest.raises(ValueError, match="force_on_policy_ratio.*rollout_rs='token_k1'"):
        _spec(True, rollout_rs="token_k1")
