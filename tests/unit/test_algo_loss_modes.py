"""Loss modes (GSPO, GSPO-token, CISPO, ratio-free REINFORCE, DRO), sequence-level TIS and the
rejection mask: hand-computed values and gradients against autograd of slow references, and the
peer frameworks' cases (NeMo-RL, slime, verl) in their own numbers."""

import math

import pytest
import torch

from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.algo.policy_loss import LossSpec, loss_denominator, loss_mask, loss_token_weights, policy_loss

# NeMo-RL's test_loss_functions.py data: one sequence, ratios 0.5 / 1.0 / 1.5 at old log-prob -1.
ADV = torch.tensor([[1.0, -1.0, 2.0]])
OLD = torch.tensor([[-1.0, -1.0, -1.0]])
CURR = torch.tensor([[-1.69315, -1.0, -0.59453]])
GEN = torch.tensor([[-0.5, -1.5, -0.8]])
ONES = torch.ones(1, 3)
TENSOR_ARGS = ("rollout_logprobs", "ref_logprobs", "entropy", "ratio_ref")  # the other keywords: LossSpec


def _loss(lp, old=OLD, adv=ADV, mask=ONES, mode="seq-mean-token-mean", **kw):
    """Loss and d loss / d lp of one call over the whole batch (denominator from loss_denominator)."""
    lp = lp.clone().requires_grad_()
    kept = loss_mask(mask, old, kw.get("rollout_logprobs"), kw.get("rollout_rs", ""),
                     kw.get("rollout_rs_threshold", 2.0), kw.get("rollout_rs_threshold_low"))
    kw.setdefault("clip_low", 0.8)
    kw.setdefault("clip_high", 1.2)
    tensors = {k: kw.pop(k) for k in TENSOR_ARGS if k in kw}
    loss, metrics = policy_loss(lp, old, adv, mask, LossSpec(loss_agg_mode=mode, **kw),
                                denominator=loss_denominator(kept, mode), **tensors)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad, reduce_metrics([metrics])


def _slow_gspo(lp, old, adv, mask, low, high, token_level, seq_weights=None):
    """GSPO written out per sequence with scalar autograd ops: s_i, the max/min form, seq-mean-token-mean."""
    total, count = 0.0, 0
    for i in range(lp.shape[0]):
        idx = [t for t in range(lp.shape[1]) if mask[i, t]]
        if not idx:
            continue
        log_s = sum(lp[i, t] - old[i, t] for t in idx) / len(idx)
        seq = 0.0
        for t in idx:
            log_st = log_s.detach() + lp[i, t] - lp[i, t].detach() if token_level else log_s
            s = torch.exp(log_st)
            a = float(adv[i, t])
            seq = seq + torch.maximum(-a * s, -a * torch.clamp(s, low, high))
        w = 1.0 if seq_weights is None else seq_weights[i]
        total = total + w * seq / len(idx)
        count += 1
    return total / count


def test_gspo_nemo_case_value_and_gradient():
    # s = exp(mean(log 0.5, 0, log 1.5)) = 0.90856, inside [0.8, 1.2]: loss = -(1 - 1 + 2) s / 3
    s = math.exp((math.log(0.5) + math.log(1.5)) / 3)
    loss, grad, m = _loss(CURR, loss_mode="gspo")
    assert s == pytest.approx(0.90856, abs=1e-4)
    assert loss == pytest.approx(-0.6057, abs=1e-4) and loss == pytest.approx(-2 * s / 3, rel=1e-4)
    # d s / d log pi_t = s / 3, and each of the 3 token terms carries it: -(sum A) s / 9 per token
    assert torch.allclose(grad, torch.full((1, 3), -2 * s / 9), rtol=1e-4)
    assert m["pg_clipfrac"] == 0.0 and m["seq_log_ratio/mean"] == pytest.approx(math.log(s), rel=1e-4)


def test_gspo_token_has_the_value_of_gspo_and_a_token_level_gradient():
    s = math.exp((math.log(0.5) + math.log(1.5)) / 3)
    loss, grad, _ = _loss(CURR, loss_mode="gspo_token")
    assert loss == pytest.approx(-2 * s / 3, rel=1e-4)
    # s_i,t = sg[s_i] pi_t / sg[pi_t]: d / d log pi_t = s, so the token's own -A_t s / 3
    assert torch.allclose(grad, -ADV * s / 3, rtol=1e-4)


def test_gspo_nemo_batch_of_two_clips_the_second_sequence():
    # NeMo's batch_size_2 case: sequence 2 has s = 2.4697 > 1.2: its A > 0 tokens clip (zero
    # gradient), its A < 0 token keeps -A s (max(2.4697, 1.2)).
    old = torch.tensor([[-1.0] * 3, [-2.0] * 3])
    lp = CURR.expand(2, 3).contiguous()
    adv = ADV.expand(2, 3).contiguous()
    loss, grad, m = _loss(lp, old, adv, torch.ones(2, 3), loss_mode="gspo")
    assert loss == pytest.approx(-0.4912, abs=1e-4)
    s2 = math.exp((math.log(0.5) + math.log(1.5)) / 3 + 1.0)
    assert s2 == pytest.approx(2.4697, abs=1e-4)
    # only the A < 0 token of sequence 2 is unclipped: -(-1) s2 / 3 / 3 on each of its tokens, over 2 sequences
    assert torch.allclose(grad[1], torch.full((3,), s2 / 9 / 2), rtol=1e-4)
    assert m["clip/high_pos"] == pytest.approx(2 / 4)


@pytest.mark.parametrize("token_level", [False, True])
def test_gspo_matches_slow_reference_on_random_data(token_level):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 7, generator=g) * 2
    lp = old + torch.randn(5, 7, generator=g) * 0.1
    adv = torch.randn(5, 7, generator=g)  # per-token advantages: GSPO and GSPO-token differ here
    mask = (torch.rand(5, 7, generator=g) > 0.3).float()
    mask[2] = 0.0
    mode = "gspo_token" if token_level else "gspo"
    loss, grad, _ = _loss(lp, old, adv, mask, loss_mode=mode, clip_low=0.97, clip_high=1.03)
    ref_lp = lp.clone().requires_grad_()
    ref = _slow_gspo(ref_lp, old, adv, mask, 0.97, 1.03, token_level)
    (ref_grad,) = torch.autograd.grad(ref, ref_lp)
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(grad, ref_grad, atol=1e-6)
    assert grad[2].abs().sum() == 0.0


def test_gspo_is_clipped_per_sequence_with_the_papers_small_epsilons():
    # one sequence: token log-ratios +0.01 and -0.0098 -> s = exp(1e-4), inside [1 - 3e-4, 1 + 4e-4],
    # though each token ratio is far outside: the clip acts on s, not on r_t.
    lp = torch.tensor([[-1.0 + 0.01, -1.0 - 0.0098]])
    loss, grad, m = _loss(lp, torch.full((1, 2), -1.0), torch.ones(1, 2), torch.ones(1, 2), loss_mode="gspo",
                          clip_low=1 - 3e-4, clip_high=1 + 4e-4)
    s = math.exp(1e-4)
    assert loss == pytest.approx(-s, rel=1e-6) and m["pg_clipfrac"] == 0.0
    assert torch.allclose(grad, torch.full((1, 2), -s / 2), rtol=1e-5)
    lp = torch.tensor([[-1.0 + 0.01, -1.0 - 0.0]])  # s = exp(5e-3) > 1 + 4e-4: clipped, zero gradient
    loss, grad, m = _loss(lp, torch.full((1, 2), -1.0), torch.ones(1, 2), torch.ones(1, 2), loss_mode="gspo",
                          clip_low=1 - 3e-4, clip_high=1 + 4e-4)
    assert loss == pytest.approx(-(1 + 4e-4), rel=1e-7) and m["pg_clipfrac"] == 1.0
    assert grad.abs().sum() == 0.0


@pytest.mark.parametrize("tis_clip, weight", [(2.0, math.exp(-0.2)), (0.8, 0.8)])
def test_sequence_level_is_weight_nemo_cases(tis_clip, weight):
    # NeMo: w = exp(sum_t (prev - gen)) = exp(-0.5 + 0.5 - 0.2) = 0.8187, truncated at 0.8 when asked
    loss, grad, m = _loss(CURR, loss_mode="gspo", rollout_logprobs=GEN, use_tis=True, tis_level="sequence",
                          tis_clip=tis_clip)
    s = math.exp((math.log(0.5) + math.log(1.5)) / 3)
    assert loss == pytest.approx(weight * -2 * s / 3, rel=1e-4)
    assert loss == pytest.approx({2.0: -0.4959, 0.8: -0.4846}[tis_clip], abs=1e-4)
    assert torch.allclose(grad, torch.full((1, 3), -weight * 2 * s / 9), rtol=1e-4)
    assert m["tis_clipfrac"] == (1.0 if tis_clip == 0.8 else 0.0)


def test_token_level_tis_under_vanilla_nemo_case():
    # NeMo token-level: max-loss [-0.5, 1.0, -2.4] times min(exp(prev - gen), 0.8) = [0.6065, 0.8, 0.8]
    loss, _, _ = _loss(CURR, rollout_logprobs=GEN, use_tis=True, tis_clip=0.8)
    assert loss == pytest.approx(-0.4744, abs=1e-4)


def test_geo_mean_and_sequence_weights_by_hand_with_padding():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]])
    rollout = old - torch.tensor([[0.3, 0.3, 0.3], [-0.4, 0.2, 9.0]])  # padding slot holds garbage
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = -torch.ones(2, 3)  # r = 1: per-token loss = w
    for level, w in (("sequence", [math.exp(0.9), math.exp(-0.2)]), ("geo_mean", [math.exp(0.3), math.exp(-0.1)])):
        loss, grad, _ = _loss(old, old, adv, mask, mode="token-mean", rollout_logprobs=rollout, use_tis=True,
                              tis_level=level, tis_clip=10.0)
        assert loss == pytest.approx((3 * w[0] + 2 * w[1]) / 5, rel=1e-5), level
        expected = torch.tensor([[w[0]] * 3, [w[1], w[1], 0.0]]) / 5
        assert torch.allclose(grad, expected, rtol=1e-5), level
        tw = loss_token_weights(mask, "token-mean", old, rollout, use_tis=True, level=level, tis_clip=10.0)
        assert torch.allclose(tw, expected * 5, rtol=1e-5), level


def test_sequence_icepop_masks_whole_sequences():
    old = torch.full((2, 2), -1.0)
    rollout = old - torch.tensor([[1.0, 1.0], [0.1, 0.1]])  # sequence weights e^2 = 7.39 (out), e^0.2 (in)
    loss, _, m = _loss(old, old, -torch.ones(2, 2), torch.ones(2, 2), mode="token-mean", rollout_logprobs=rollout,
                       use_tis=True, tis_level="sequence", tis_mode="icepop")
    assert loss == pytest.approx(2 * math.exp(0.2) / 4, rel=1e-6)
    assert m["tis_clipfrac"] == 0.5


@pytest.mark.parametrize("eps_clip, eps_clip_high, ratios, clamped", [
    (0.2, 0.28, [1.0, 1.14, 1.56, 0.4], [1.0, 1.14, 1.28, 0.8]),  # slime's ppo_band
    (1.0, 4.0, [1.0, 3.0, 9.0, 0.4], [1.0, 3.0, 5.0, 0.4]),  # slime's wide_minimax_band: no lower bound
])
def test_cispo_slime_cases_values_and_gradient_through_log_pi_only(eps_clip, eps_clip_high, ratios, clamped):
    adv = torch.tensor([[1.0, -0.5, 2.0, -1.0]])
    lp = torch.tensor([[-0.7, -1.2, -0.4, -2.1]])
    old = lp - torch.log(torch.tensor([ratios]))
    loss, grad, m = _loss(lp, old, adv, torch.ones(1, 4), mode="seq-mean-token-sum", loss_mode="cispo",
                          clip_low=max(0.0, 1 - eps_clip), clip_high=1 + eps_clip_high)
    c = torch.tensor([clamped])
    assert loss == pytest.approx(float((-c * adv * lp).sum()), rel=1e-5)
    # sg on the clipped ratio: d/d log pi = -clip(r) A, for clipped tokens too (no zero gradient)
    assert torch.allclose(grad, -c * adv, rtol=1e-5)
    assert m["cispo_clipfrac"] == pytest.approx(sum(a != b for a, b in zip(ratios, clamped)) / 4)
    assert m["pg_clipfrac"] == 0.0


def test_cispo_nemo_cases_with_and_without_importance_sampling():
    r_clamped = torch.tensor([[0.8, 1.0, 1.2]])
    loss, grad, _ = _loss(CURR, mode="token-mean", loss_mode="cispo")
    assert loss == pytest.approx(float((-ADV * r_clamped * CURR).mean()), rel=1e-4)
    assert torch.allclose(grad, -ADV * r_clamped / 3, rtol=1e-4)
    iw = torch.exp(OLD - GEN)  # NeMo's untruncated token IS weights [0.6065, 1.6487, 0.8187]
    loss, grad, _ = _loss(CURR, mode="token-mean", loss_mode="cispo", rollout_logprobs=GEN, use_tis=True,
                          tis_clip=math.inf)
    assert loss == pytest.approx(float((iw * -ADV * r_clamped * CURR).mean()), rel=1e-4)
    assert torch.allclose(grad, -iw * ADV * r_clamped / 3, rtol=1e-4)


def test_ratio_free_reinforce_nemo_case():
    lp = torch.tensor([[-0.5, -1.0, -1.5]])
    loss, grad, _ = _loss(lp, torch.zeros(1, 3), mode="token-mean", loss_mode="reinforce")
    assert loss == pytest.approx(2.5 / 3, rel=1e-6)  # -A log pi = [0.5, -1.0, 3.0]
    assert torch.allclose(grad, -ADV / 3)


def test_dro_value_and_gradient_against_slow_reference():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 4, generator=g) * 2
    lp = old + torch.randn(3, 4, generator=g) * 0.5
    adv = torch.randn(3, 4, generator=g)
    mask = (torch.rand(3, 4, generator=g) > 0.2).float()
    loss, grad, _ = _loss(lp, old, adv, mask, mode="token-mean", loss_mode="dro", dro_beta=0.7)
    ref_lp = lp.clone().requires_grad_()
    # Tinker's formula: -(target_logprobs * A - 0.5 beta (target - sampling)^2), token mean here
    terms = [-(ref_lp[b, t] * adv[b, t] - 0.35 * (ref_lp[b, t] - old[b, t]) ** 2)
             for b in range(3) for t in range(4) if mask[b, t]]
    ref = sum(terms) / len(terms)
    (ref_grad,) = torch.autograd.grad(ref, ref_lp)
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(grad, ref_grad, atol=1e-7)
    assert torch.allclose(grad[mask.bool()], ((-adv + 0.7 * (lp - old)) / mask.sum())[mask.bool()], atol=1e-7)


def test_rejection_mask_with_tis_verl_mask_mode_case():
    # verl's test_mask_mode: old -2; rollout -1 (w = e^-1 = 0.37, k1 = +1 > log 2: rejected) and
    # -2.5 (w = e^0.5 = 1.65, kept); TIS truncates at 2 on the rest.
    old = torch.full((2, 5), -2.0)
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    adv = -torch.ones(2, 5)  # r = 1: per-token loss = w
    loss, grad, m = _loss(old, old, adv, torch.ones(2, 5), mode="token-mean", rollout_logprobs=rollout,
                          use_tis=True, rollout_rs="token_k1", rollout_rs_threshold=2.0,
                          rollout_rs_threshold_low=0.5)
    assert loss == pytest.approx(math.exp(0.5), rel=1e-6)  # 5 kept tokens over a denominator of 5
    assert torch.allclose(grad, torch.tensor([[0.0] * 5, [math.exp(0.5) / 5] * 5]), rtol=1e-6)
    assert m["rollout_rs_masked_fraction"] == 0.5
    # mismatch is measured on the pre-rejection mask: both sequences
    assert m["mismatch/abs_logprob_diff"] == pytest.approx(0.75)


def test_rejection_threshold_direction_is_verls_k1():
    # k1 = log pi_rollout - log pi_old kept in [log 0.9, log 1.5]
    old = torch.zeros(1, 4)
    rollout = torch.tensor([[0.2, -0.2, 0.39, 0.42]])  # k1 = 0.2, -0.2, 0.39, 0.42
    kept = loss_mask(torch.ones(1, 4), old, rollout, "token_k1", 1.5, 0.9)
    assert kept.tolist() == [[True, False, True, False]]
    kept = loss_mask(torch.ones(1, 4), old, rollout, "token_k1", 1.5)  # low = 1 / 1.5
    assert kept.tolist() == [[True, True, True, False]]
    weights = loss_token_weights(torch.ones(1, 4), "seq-mean-token-mean", old, rollout, rollout_rs="token_k1",
                                 rollout_rs_threshold=1.5, rollout_rs_threshold_low=0.9)
    assert torch.allclose(weights, torch.tensor([[0.5, 0.0, 0.5, 0.0]]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_mode="ppo2"), "loss_mode"),
    (dict(loss_mode="cispo", eps_clip_c=3.0), "eps_clip_c"),
    (dict(rollout_rs="token_k1"), "rollout_logprobs"),
    (dict(rollout_rs="seq_k9", rollout_logprobs=torch.zeros(2, 3)), "rollout_rs"),
    (dict(use_tis=True, rollout_logprobs=torch.zeros(2, 3), tis_level="seq"), "tis_level"),
    (dict(rollout_rs="token_k1", rollout_logprobs=torch.zeros(2, 3), rollout_rs_threshold_low=3.0),
     "rollout_rs_threshold"),
])
def test_bad_arguments_name_the_knob(kwargs, match):
    tensors = {k: kwargs.pop(k) for k in TENSOR_ARGS if k in kwargs}
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3),
                    LossSpec(clip_low=0.8, clip_high=1.2, **kwargs), denominator=1.0, **tensors)
