"""Policy loss: hand-computed values per variant, exact zero gradients of clipped tokens, aggregation."""

import math

import pytest
import torch

from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.algo.policy_loss import LossSpec, bounds_from_eps, loss_denominator, policy_loss

NAN = float("nan")

# One row of six tokens, L = 0.8, H = 1.2. Per token max(-A r, -A clip(r)):
#   r:    0.5   0.9   1.0   1.3    0.7    4.0
#   A:    -1    -1    2     2      1      -1
#   loss: 0.8   0.9   -2    -2.4   -0.7   4.0   (dual-clip c = 3: last one 3.0)
#   clip: low   -     -     high   (low_pos) (high_neg; dual with c = 3)
RATIOS = [0.5, 0.9, 1.0, 1.3, 0.7, 4.0]
ADVS = [-1.0, -1.0, 2.0, 2.0, 1.0, -1.0]


def _row(values, pad=(NAN, NAN)):
    """[2, 8] tensor: row 0 holds the 6 values + 2 padded slots, row 1 is padding only."""
    return torch.tensor([list(values) + list(pad), [NAN] * 8])


def _inputs():
    old = _row([-1.0] * 6)
    logprobs = (old + torch.log(_row(RATIOS))).nan_to_num(7.0).requires_grad_()
    mask = torch.zeros(2, 8)
    mask[0, :6] = 1.0
    return logprobs, old, _row(ADVS), mask


def test_bounds_from_eps():
    assert bounds_from_eps(0.2) == (0.8, 1.2)
    low, high = bounds_from_eps(0.2, 0.28)
    assert low == 0.8 and high == pytest.approx(1.28)
    with pytest.raises(ValueError, match="eps_clip"):
        bounds_from_eps(1.0)


def test_ppo_clip_values_gradients_and_clip_metrics_by_hand():
    logprobs, old, adv, mask = _inputs()
    loss, metrics = policy_loss(logprobs, old, adv, mask, LossSpec(clip_low=0.8, clip_high=1.2), denominator=6.0)
    assert loss.item() == pytest.approx((0.8 + 0.9 - 2.0 - 2.4 - 0.7 + 4.0) / 6, abs=1e-6)
    loss.backward()
    # d/dlogp of -A r is -A r; clipped tokens exactly 0; padding exactly 0 despite NaN inputs.
    expected = torch.zeros(2, 8)
    expected[0, :6] = torch.tensor([0.0, 0.9, -2.0, 0.0, -0.7, 4.0]) / 6
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    assert logprobs.grad[0, 0] == 0.0 and logprobs.grad[0, 3] == 0.0
    m = reduce_metrics([metrics])
    assert m["clip/low_neg"] == pytest.approx(1 / 3) and m["clip/high_pos"] == pytest.approx(1 / 3)
    assert m["clip/low_pos"] == pytest.approx(1 / 3) and m["clip/high_neg"] == pytest.approx(1 / 3)
    assert m["pg_clipfrac"] == pytest.approx(2 / 6)
    assert m["pg_loss"] == pytest.approx(loss.item()) and m["loss"] == pytest.approx(loss.item())
    log_r = [math.log(r) for r in RATIOS]
    assert m["ppo_kl"] == pytest.approx(-sum(log_r) / 6, abs=1e-6)
    mean = sum(log_r) / 6
    assert m["log_ratio/std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in log_r) / 6), abs=1e-6)
    assert m["nonfinite_logprobs"] == 0.0


def test_dual_clip_by_hand():
    logprobs, old, adv, mask = _inputs()
    loss, metrics = policy_loss(logprobs, old, adv, mask, LossSpec(clip_low=0.8, clip_high=1.2, eps_clip_c=3.0),
                                denominator=6.0)
    assert loss.item() == pytest.approx((0.8 + 0.9 - 2.0 - 2.4 - 0.7 + 3.0) / 6, abs=1e-6)
    loss.backward()
    assert torch.allclose(logprobs.grad[0, :6], torch.tensor([0.0, 0.9, -2.0, 0.0, -0.7, 0.0]) / 6, atol=1e-6)
    m = reduce_metrics([metrics])
    assert m["clip/dual"] == pytest.approx(1 / 3) and m["pg_clipfrac"] == pytest.approx(3 / 6)
    with pytest.raises(ValueError, match="eps_clip_c"):
        policy_loss(logprobs, old, adv, mask, LossSpec(clip_low=0.8, clip_high=1.2, eps_clip_c=1.0), denominator=6.0)


def test_negative_advantage_gradient_is_zero_iff_ratio_below_low():
    torch.manual_seed(0)
    log_ratio = torch.linspace(-0.6, 0.6, 241).reshape(1, -1)
    tie = torch.tensor([[-0.25]])  # a token sitting exactly on L: not clipped (ties keep the gradient)
    log_ratio = torch.cat([log_ratio, tie], dim=1)
    low = float(torch.exp(tie))
    old = torch.randn_like(log_ratio)
    logprobs = (old + log_ratio).requires_grad_()
    adv = -torch.rand_like(log_ratio) - 0.1
    loss, _ = policy_loss(logprobs, old, adv, torch.ones_like(adv), LossSpec(clip_low=low, clip_high=1.2),
                          denominator=1.0)
    loss.backward()
    ratio = torch.exp(logprobs.detach() - old)
    assert torch.equal(logprobs.grad == 0, ratio < low)
    assert logprobs.grad[0, -1] != 0.0
    # unclipped: exactly -A r
    free = ratio >= low
    assert torch.allclose(logprobs.grad[free], (-adv * ratio)[free], rtol=1e-6)


def _agg_inputs():
    """Three rows at r = 1 (loss -A): row 0 three tokens, row 1 one token, row 2 fully masked."""
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    logprobs = torch.full((3, 3), -1.0, requires_grad=True)
    return logprobs, logprobs.detach().clone(), adv, mask


@pytest.mark.parametrize("mode, denominator, expected", [
    ("token-mean", 4.0, -10.0 / 4),
    ("seq-mean-token-mean", 2.0, (-6.0 / 3 - 4.0) / 2),
    ("seq-mean-token-sum", 2.0, -10.0 / 2),
])
def test_aggregation_modes_by_hand(mode, denominator, expected):
    logprobs, old, adv, mask = _agg_inputs()
    assert loss_denominator(mask, mode) == denominator  # fully masked row 2 is left out
    loss, metrics = policy_loss(logprobs, old, adv, mask, LossSpec(clip_low=0.8, clip_high=1.2, loss_agg_mode=mode),
                                denominator=denominator)
    assert loss.item() == pytest.approx(expected)
    assert reduce_metrics([metrics])["pg_loss"] == pytest.approx(expected)


def test_loss_denominator_over_micro_batches_and_empty():
    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 0, 0]])]
    assert loss_denominator(masks, "token-mean") == 3.0
    assert loss_denominator(masks, "seq-mean-token-sum") == 2.0
    assert loss_denominator(torch.zeros(2, 3), "token-mean") == 1.0
    calls = []

    def doubling_reduce(t):
        calls.append(t.clone())
        return t.mul_(2)

    assert loss_denominator(masks, "token-mean", reduce=doubling_reduce) == 6.0
    assert len(calls) == 1 and calls[0].dtype == torch.float64
    with pytest.raises(ValueError, match="loss_agg_mode"):
        loss_denominator(masks, "sum")


def _tis_inputs(log_w):
    n = len(log_w)
    logprobs = torch.full((1, n), -1.0, requires_grad=True)
    old = logprobs.detach().clone()
    rollout = old - torch.tensor([log_w])
    adv = -torch.ones(1, n)  # r = 1, A = -1: per-token loss w * 1, gradient w * 1
    return logprobs, old, rollout, adv, torch.ones(1, n)


def test_tis_truncation_by_hand():
    logprobs, old, rollout, adv, mask = _tis_inputs([math.log(3.0), math.log(0.5), 0.0])
    loss, metrics = policy_loss(logprobs, old, adv, mask, LossSpec(clip_low=0.8, clip_high=1.2, use_tis=True),
                                denominator=3.0, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx((2.0 + 0.5 + 1.0) / 3, rel=1e-6)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[2.0, 0.5, 1.0]]) / 3, rtol=1e-6)
    assert reduce_metrics([metrics])["tis_clipfrac"] == pytest.approx(1 / 3)
    loss, metrics = policy_loss(logprobs, old, adv, mask, LossSpec(clip_low=0.8, clip_high=1.2, use_tis=True,
                                tis_clip_low=0.6), denominator=3.0, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx((2.0 + 0.6 + 1.0) / 3, rel=1e-6)
    assert reduce_metrics([metrics])["tis_clipfrac"] == pytest.approx(2 / 3)


def test_icepop_masks_out_of_band_tokens_but_keeps_them_in_denominator():
    logprobs, old, rollout, adv, mask = _tis_inputs([math.log(6.0), math.log(0.5), 0.0, math.log(0.4), math.log(5.0)])
    loss, metrics = policy_loss(logprobs, old, adv, mask, LossSpec(clip_low=0.8, clip_high=1.2, use_tis=True,
                                tis_mode="icepop"), denominator=5.0, rollout_logprobs=rollout)
    # band [0.5, 5] inclusive: weights 0, 0.5, 1, 0, 5
    assert loss.item() == pytest.approx((0.5 + 1.0 + 5.0) / 5, rel=1e-6)
    assert reduce_metrics([metrics])["tis_clipfrac"] == pytest.approx(2 / 5)


def test_mismatch_metrics_and_ess_by_hand():
    logprobs = torch.tensor([[-1.0, -1.0, 0.0]], requires_grad=True)
    old = logprobs.detach().clone()
    rollout = torch.tensor([[-1.1, -0.8, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, metrics = policy_loss(logprobs, old, torch.ones(1, 3), mask, LossSpec(clip_low=0.8, clip_high=1.2),
                             denominator=2.0, rollout_logprobs=rollout)
    m = reduce_metrics([metrics])
    d = [0.1, -0.2]
    assert m["mismatch/abs_logprob_diff"] == pytest.approx(0.15, rel=1e-6)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.exp(0.2)) / 2, rel=1e-6)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 2, rel=1e-5)
    w = [math.exp(x) for x in d]
    assert m["ess"] == pytest.approx((sum(w) / 2) ** 2 / (sum(x * x for x in w) / 2), rel=1e-6)
    assert "tis_clipfrac" not in m  # mismatch is measured without TIS; TIS metrics only with use_tis


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_kl_penalty_values_and_gradient_by_hand(kl_type):
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    d = [-0.5, 1.0]  # ref - new
    per_token = {"k1": [-x for x in d], "k2": [x * x / 2 for x in d], "k3": [math.exp(x) - 1 - x for x in d]}[kl_type]
    grad = {"k1": [1.0, 1.0], "k2": [-x for x in d], "k3": [1 - math.exp(x) for x in d]}[kl_type]
    loss, metrics = policy_loss(logprobs, logprobs.detach(), torch.zeros(1, 2), torch.ones(1, 2),
                                LossSpec(clip_low=0.8, clip_high=1.2, kl_loss_type=kl_type,
                                kl_loss_coef=0.1), denominator=2.0, ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.1 * sum(per_token) / 2, rel=1e-6)
    assert reduce_metrics([metrics])["kl_loss"] == pytest.approx(sum(per_token) / 2, rel=1e-6)
    loss.backward()
    assert torch.allclose(logprobs.grad, 0.1 * torch.tensor([grad]) / 2, rtol=1e-5)


def test_entropy_bonus_by_hand():
    entropy = torch.tensor([[1.0, 3.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    lp = torch.zeros(1, 3)
    loss, metrics = policy_loss(lp, lp, torch.zeros(1, 3), mask, LossSpec(clip_low=0.8, clip_high=1.2,
                                entropy_coef=0.01), denominator=2.0, entropy=entropy)
    assert loss.item() == pytest.approx(-0.01 * 4.0 / 2)
    loss.backward()
    assert torch.allclose(entropy.grad, torch.tensor([[-0.005, -0.005, 0.0]]))
    assert reduce_metrics([metrics])["entropy"] == pytest.approx(2.0)


def test_false_clip_metrics_by_hand():
    logprobs = torch.log(torch.tensor([[0.7, 0.7, 0.9, 0.9, 1.5, 1.1]]))
    ratio_ref = torch.tensor([[0.85, 0.75, 0.75, 0.9, 1.1, 1.3]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, -1.0, 1.0, 1.0]])
    _, metrics = policy_loss(logprobs, torch.zeros(1, 6), adv, torch.ones(1, 6), LossSpec(clip_low=0.8, clip_high=1.2,
                             ref_clip_low=0.8, ref_clip_high=1.2), denominator=6.0,
                             ratio_ref=ratio_ref)
    m = reduce_metrics([metrics])
    # A<0: fp8 clips tokens 0, 1; ref clips 1, 2 -> false {0}, missed {2}
    assert m["false_clip/low_neg"] == pytest.approx(1 / 4) and m["missed_clip/low_neg"] == pytest.approx(1 / 4)
    assert m["false_clip/share"] == pytest.approx(1 / 2) and m["clip/low_neg_ref"] == pytest.approx(2 / 4)
    # A>0: fp8 clips token 4 (1.5 > 1.2), ref clips token 5 (1.3 > 1.2)
    assert m["false_clip/high_pos"] == pytest.approx(1 / 2) and m["missed_clip/high_pos"] == pytest.approx(1 / 2)


def _reference_loss(lp, old, adv, mask, rollout, ref, ent, low, high, c, tis_clip, kl_coef, ent_coef, denom):
    """Slow per-token reference: max/min formula, TIS truncation, k3 KL, entropy, token-mean."""
    total = 0.0
    for b in range(len(lp)):
        for t in range(len(lp[0])):
            if not mask[b][t]:
                continue
            r = math.exp(lp[b][t] - old[b][t])
            a = adv[b][t]
            term = max(-a * r, -a * min(max(r, low), high))
            if c is not None and a < 0:
                term = min(term, -a * c)
            w = min(math.exp(old[b][t] - rollout[b][t]), tis_clip)
            d = ref[b][t] - lp[b][t]
            total += w * term + kl_coef * (math.exp(d) - 1 - d) - ent_coef * ent[b][t]
    return total / denom


def test_matches_slow_reference_on_random_data():
    torch.manual_seed(1)
    shape = (5, 9)
    old = -torch.rand(shape) * 3
    lp = old + torch.randn(shape) * 0.3
    rollout = old + torch.randn(shape) * 0.4
    ref = old + torch.randn(shape) * 0.2
    ent = torch.rand(shape)
    adv = torch.randn(5, 1).expand(shape).contiguous()
    mask = (torch.rand(shape) > 0.3).float()
    kwargs = dict(clip_low=0.75, clip_high=1.3, eps_clip_c=2.5)
    loss, _ = policy_loss(lp, old, adv, mask, LossSpec(use_tis=True, kl_loss_coef=0.05, entropy_coef=0.01, **kwargs),
                          denominator=float(mask.sum()), rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent)
    expected = _reference_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), rollout.tolist(), ref.tolist(),
                               ent.tolist(), 0.75, 1.3, 2.5, 2.0, 0.05, 0.01, float(mask.sum()))
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_give_the_gradient_and_metrics_of_one_big_batch(mode):
    torch.manual_seed(2)
    shape = (6, 7)
    old = -torch.rand(shape) * 2
    lp = (old + torch.randn(shape) * 0.3).requires_grad_()
    rollout, ref, ent = old + torch.randn(shape) * 0.2, old + 0.1, torch.rand(shape)
    adv = torch.randn(6, 1).expand(shape).contiguous()
    mask = (torch.rand(shape) > 0.3).float()
    mask[4] = 0.0  # a fully masked sequence
    kw = dict(clip_low=0.8, clip_high=1.28, eps_clip_c=3.0, loss_agg_mode=mode, use_tis=True, kl_loss_coef=0.1,
              entropy_coef=0.01)

    def run(rows_list):
        denom = loss_denominator([mask[r] for r in rows_list], mode)
        losses, metrics = [], []
        for r in rows_list:
            loss, m = policy_loss(lp[r], old[r], adv[r], mask[r], LossSpec(**kw), denominator=denom,
                                  rollout_logprobs=rollout[r], ref_logprobs=ref[r], entropy=ent[r])
            losses.append(loss)
            metrics.append(m)
        total = torch.stack(losses).sum()
        (grad,) = torch.autograd.grad(total, lp)
        return total.item(), grad, reduce_metrics(metrics)

    full = run([slice(0, 6)])
    split = run([slice(0, 1), slice(1, 4), slice(4, 6)])
    assert split[0] == pytest.approx(full[0], rel=1e-6)
    assert torch.allclose(split[1], full[1], atol=1e-7)
    assert split[2].keys() == full[2].keys()
    for key, value in full[2].items():
        assert split[2][key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key
    assert full[2]["loss"] == pytest.approx(full[0], rel=1e-6)


def test_nan_in_valid_tokens_propagates_and_is_counted():
    lp = torch.tensor([[-1.0, NAN, -1.0]], requires_grad=True)
    loss, metrics = policy_loss(lp, torch.full((1, 3), -1.0), torch.ones(1, 3), torch.ones(1, 3),
                                LossSpec(clip_low=0.8, clip_high=1.2), denominator=3.0)
    assert math.isnan(loss.item())  # never a silent wrong update: the trainer sees a non-finite loss
    assert reduce_metrics([metrics])["nonfinite_logprobs"] == pytest.approx(1 / 3)


TENSOR_ARGS = ("denominator", "rollout_logprobs", "ref_logprobs", "entropy", "ratio_ref")  # the rest: LossSpec


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_agg_mode="mean"), "loss_agg_mode"),
    (dict(kl_loss_type="k4"), "kl_loss_type"),
    (dict(denominator=0.0), "denominator"),
    (dict(clip_low=1.3), "clip_low"),
    (dict(use_tis=True), "rollout_logprobs"),
    (dict(kl_loss_coef=0.1), "ref_logprobs"),
    (dict(entropy_coef=0.1), "entropy"),
    (dict(use_tis=True, rollout_logprobs=torch.zeros(2, 3), tis_mode="clip"), "tis_mode"),
    (dict(use_tis=True, rollout_logprobs=torch.zeros(2, 3), tis_clip=0.0), "tis_clip"),
    (dict(ref_logprobs=torch.zeros(3, 2)), "ref_logprobs"),
])
def test_bad_arguments_raise_value_error_naming_the_knob(kwargs, match):
    args = dict(denominator=1.0, clip_low=0.8, clip_high=1.2)
    args.update(kwargs)
    tensors = {k: args.pop(k) for k in TENSOR_ARGS if k in args}
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), LossSpec(**args),
                    **tensors)
