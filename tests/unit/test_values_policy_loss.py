"""Value tests of policy_loss with its knobs crossed: every loss mode x aggregation x dual-clip x
TIS / IcePop at token, sequence and geo-mean level x rejection x KL type x entropy x
force_on_policy_ratio x reference ratio, against a slow reference written token by token from the
docstrings (plain Python branches on float64 scalars; autograd only differentiates the reference's
own arithmetic). The loss, its gradient and every metric it emits are compared, so a knob that is
logged but not used, or used with the wrong mask or denominator, fails."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.algo.policy_loss import LossSpec, loss_denominator, loss_mask, loss_token_weights, policy_loss

L, H, C = 0.8, 1.2, 3.0
CLAMP = 20.0
B, T = 3, 5


def _mean(pairs):
    """Mean of the values of (value, selected) pairs over the selected; NaN over none."""
    vals = [v for v, sel in pairs if sel]
    return sum(vals) / len(vals) if vals else math.nan


def _moments(prefix, pairs, out):
    out[f"{prefix}/mean"] = mean = _mean(pairs)
    out[f"{prefix}/mean_sq"] = sq = _mean([(v * v, s) for v, s in pairs])
    out[f"{prefix}/std"] = math.sqrt(max(sq - mean * mean, 0.0)) if not math.isnan(mean) else math.nan


def _clamp(x, lo=-CLAMP, hi=CLAMP):
    return min(max(x, lo), hi)


def _tis_weights(old, rollout, response, s):
    """[b][t] weights of the rollout correction and whether each was changed."""
    w, changed = [], []
    for b in range(B):
        d = [old[b][t] - rollout[b][t] if response[b][t] else 0.0 for t in range(T)]
        n = sum(response[b])
        if s.tis_level == "token":
            logs = d
        else:
            total = sum(d) / (max(n, 1) if s.tis_level == "geo_mean" else 1)
            logs = [total] * T
        raw = [math.exp(_clamp(x)) for x in logs]
        if s.tis_mode == "truncate":
            applied = [min(max(x, s.tis_clip_low), s.tis_clip) for x in raw]
        else:
            applied = [x if s.icepop_low <= x <= s.icepop_high else 0.0 for x in raw]
        w.append(applied)
        changed.append([a != r for a, r in zip(applied, raw)])
    return w, changed


CELLS = [(b, t) for b in range(B) for t in range(T)]


def _kept(response, old, rollout, s, m):
    """The tokens the loss aggregates: the response less what token_k1 rejection drops."""
    if not s.rollout_rs:
        return response
    low = 1.0 / s.rollout_rs_threshold if s.rollout_rs_threshold_low is None else s.rollout_rs_threshold_low
    kept = [[response[b][t] and math.log(low) <= _clamp(rollout[b][t] - old[b][t]) <= math.log(s.rollout_rs_threshold)
             for t in range(T)] for b in range(B)]
    m["rollout_rs_masked_fraction"] = _mean([(float(not kept[b][t]), response[b][t]) for b, t in CELLS])
    return kept


def _token_term(s, a, lp, log_r, seq):
    """(per-token surrogate, the ratio the clip saw, (low, high, dual) clip flags) of one token."""
    if s.loss_mode == "gspo":
        x = torch.exp(seq.clamp(-CLAMP, CLAMP))
    elif s.loss_mode == "gspo_token":
        x = torch.exp(seq.detach().clamp(-CLAMP, CLAMP)) * torch.exp(lp - lp.detach())
    else:
        x = torch.exp(log_r.clamp(-CLAMP, CLAMP))
    r, flags = float(x), [False, False, False]
    if s.loss_mode == "cispo":
        return -min(max(r, s.clip_low), s.clip_high) * a * lp, r, flags
    if s.loss_mode == "reinforce":
        return -a * lp, r, flags
    if s.loss_mode == "dro":
        return -(a * lp - 0.5 * s.dro_beta * log_r ** 2), r, flags
    f = x  # the clipped modes: a clipped branch is a constant (zero gradient)
    if a < 0 and r < s.clip_low:
        f, flags[0] = s.clip_low, True
    elif a > 0 and r > s.clip_high:
        f, flags[1] = s.clip_high, True
    if s.eps_clip_c is not None and a < 0 and float(f) > s.eps_clip_c:
        f, flags[2] = s.eps_clip_c, True
    return -a * f, r, flags


def _penalties(lp_t, valid, ref, ent, s, m):
    pen = {k: 0.0 for k in CELLS}
    if ref is not None:
        kl = {}
        for b, t in CELLS:
            d = ref[b][t] - lp_t[b][t]
            dc = d.clamp(-CLAMP, CLAMP)
            kl[b, t] = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(dc) - 1 - dc}[s.kl_loss_type]
            pen[b, t] = pen[b, t] + s.kl_loss_coef * kl[b, t]
        m["kl_loss"] = _mean([(float(kl[k]), valid[k[0]][k[1]]) for k in CELLS])
    if ent is not None:
        for b, t in CELLS:
            pen[b, t] = pen[b, t] - s.entropy_coef * ent[b][t]
        m["entropy"] = _mean([(ent[b][t], valid[b][t]) for b, t in CELLS])
    return pen


def _aggregate(per_token, valid, mode):
    """(numerator, count): token-mean over tokens; seq-mean-* over sequences holding a kept token."""
    rows = [[per_token[b, t] for t in range(T) if valid[b][t]] for b in range(B)]
    if mode == "token-mean":
        return sum(sum(r) for r in rows), sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r), sum(1 for r in rows if r)
    return sum(sum(r) for r in rows), sum(1 for r in rows if r)


def _ratio_metrics(valid, adv, lr, ratio, flags, seq, s, m):
    sel = [valid[b][t] for b, t in CELLS]
    neg = [valid[b][t] and adv[b][t] < 0 for b, t in CELLS]
    pos = [valid[b][t] and adv[b][t] > 0 for b, t in CELLS]
    m["ppo_kl"] = _mean([(-x, v) for x, v in zip(lr, sel)])
    _moments("log_ratio", list(zip(lr, sel)), m)
    m["clip/low_neg"] = _mean([(float(f[0]), n) for f, n in zip(flags, neg)])
    m["clip/high_pos"] = _mean([(float(f[1]), p) for f, p in zip(flags, pos)])
    m["clip/low_pos"] = _mean([(float(r < s.clip_low), p) for r, p in zip(ratio, pos)])
    m["clip/high_neg"] = _mean([(float(r > s.clip_high), n) for r, n in zip(ratio, neg)])
    m["pg_clipfrac"] = _mean([(float(any(f)), v) for f, v in zip(flags, sel)])
    if s.eps_clip_c is not None:
        m["clip/dual"] = _mean([(float(f[2]), n) for f, n in zip(flags, neg)])
    if s.loss_mode in ("gspo", "gspo_token"):
        _moments("seq_log_ratio", [(float(seq[b]), any(valid[b])) for b in range(B)], m)
    if s.loss_mode == "cispo":
        m["cispo_clipfrac"] = _mean([(float(not s.clip_low <= r <= s.clip_high), v) for r, v in zip(ratio, sel)])


def _mismatch_metrics(old, rollout, response, m):
    """Over the response (rejection cannot hide mismatch); d = log pi_old - log pi_rollout."""
    d = [old[b][t] - rollout[b][t] for b, t in CELLS]
    sel = [response[b][t] for b, t in CELLS]
    m["mismatch/abs_logprob_diff"] = _mean([(abs(x), v) for x, v in zip(d, sel)])
    m["mismatch/token_mult_prob_error"] = _mean([(math.exp(abs(_clamp(x))), v) for x, v in zip(d, sel)])
    m["mismatch/k3_kl"] = _mean([(math.exp(_clamp(x)) - 1 - _clamp(x), v) for x, v in zip(d, sel)])
    _moments("is_weight", [(math.exp(_clamp(x)), v) for x, v in zip(d, sel)], m)
    m["ess"] = min(m["is_weight/mean"] ** 2 / m["is_weight/mean_sq"], 1.0)


def _reference(lp, old_in, adv, mask, rollout, ref, ent, ratio_ref, s):
    """(loss, d loss / d lp as [B][T] floats, metrics) from the docstrings, token by token."""
    lp_t = [[torch.tensor(lp[b][t], dtype=torch.float64, requires_grad=True) for t in range(T)] for b in range(B)]
    old = lp if s.force_on_policy_ratio else old_in
    response = [[bool(mask[b][t]) for t in range(T)] for b in range(B)]
    m: dict[str, float] = {"nonfinite_logprobs": 0.0}
    valid = _kept(response, old, rollout, s, m)
    log_r = {(b, t): lp_t[b][t] - old[b][t] for b, t in CELLS}
    zero = torch.tensor(0.0, dtype=torch.float64)
    seq = [sum((log_r[b, t] for t in range(T) if valid[b][t]), zero) / max(sum(valid[b]), 1) for b in range(B)]
    terms = {(b, t): _token_term(s, adv[b][t], lp_t[b][t], log_r[b, t], seq[b]) for b, t in CELLS}
    pg = {k: v[0] for k, v in terms.items()}
    if s.use_tis:
        w, changed = _tis_weights(old, rollout, response, s)
        m["tis_clipfrac"] = _mean([(float(changed[b][t]), response[b][t]) for b, t in CELLS])
        pg = {(b, t): v * w[b][t] for (b, t), v in pg.items()}
    pen = _penalties(lp_t, valid, ref, ent, s, m)
    total, count = _aggregate({k: pg[k] + pen[k] for k in CELLS}, valid, s.loss_agg_mode)
    loss = torch.as_tensor(total, dtype=torch.float64) / max(count, 1)
    grad = [[0.0] * T for _ in range(B)]
    if loss.requires_grad:  # (rejection may keep no token)
        grads = torch.autograd.grad(loss, [x for row in lp_t for x in row], allow_unused=True)
        grad = [[0.0 if g is None else float(g) for g in grads[b * T:(b + 1) * T]] for b in range(B)]
    m["loss"] = float(total) / count if count else math.nan
    m["pg_loss"] = float(_aggregate(pg, valid, s.loss_agg_mode)[0]) / count if count else math.nan
    _ratio_metrics(valid, adv, [float(log_r[k]) for k in CELLS], [terms[k][1] for k in CELLS],
                   [terms[k][2] for k in CELLS], seq, s, m)
    if rollout is not None:
        _mismatch_metrics(old, rollout, response, m)
    if ratio_ref is not None:
        flags = {k: terms[k][2] for k in CELLS}
        _reference_clip_metrics(ratio_ref, valid, adv, {k: f[0] for k, f in flags.items()},
                                {k: f[1] for k, f in flags.items()}, s, m)
    return float(loss), grad, m


def _reference_clip_metrics(ratio_ref, valid, adv, low_c, high_c, s, m):
    cells = CELLS
    rref = {k: ratio_ref[k[0]][k[1]] for k in cells}
    if s.loss_mode in ("gspo", "gspo_token"):  # the sequence ratio of the reference, like the clip's
        for b in range(B):
            logs = [math.log(ratio_ref[b][t]) for t in range(T) if valid[b][t]]
            for t in range(T):
                rref[b, t] = math.exp(sum(logs) / max(len(logs), 1))
    lo = s.clip_low if s.ref_clip_low is None else s.ref_clip_low
    hi = s.clip_high if s.ref_clip_high is None else s.ref_clip_high
    neg = {k: valid[k[0]][k[1]] and adv[k[0]][k[1]] < 0 for k in cells}
    pos = {k: valid[k[0]][k[1]] and adv[k[0]][k[1]] > 0 for k in cells}
    ref_low = {k: neg[k] and rref[k] < lo for k in cells}
    ref_high = {k: pos[k] and rref[k] > hi for k in cells}
    m["false_clip/low_neg"] = _mean([(float(low_c[k] and not ref_low[k]), neg[k]) for k in cells])
    m["missed_clip/low_neg"] = _mean([(float(ref_low[k] and not low_c[k]), neg[k]) for k in cells])
    m["false_clip/share"] = _mean([(float(not ref_low[k]), low_c[k] and valid[k[0]][k[1]]) for k in cells])
    m["false_clip/high_pos"] = _mean([(float(high_c[k] and not ref_high[k]), pos[k]) for k in cells])
    m["missed_clip/high_pos"] = _mean([(float(ref_high[k] and not high_c[k]), pos[k]) for k in cells])
    m["clip/low_neg_ref"] = _mean([(float(ref_low[k]), neg[k]) for k in cells])
    m["clip/high_pos_ref"] = _mean([(float(ref_high[k]), pos[k]) for k in cells])
    _moments("log_ratio_ref", [(math.log(rref[k]), valid[k[0]][k[1]]) for k in cells], m)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2 - 0.1
    lp = old + torch.randn(B, T, generator=g) * 0.3
    batch = dict(
        lp=lp, old=old, adv=torch.randn(B, T, generator=g),
        mask=(torch.rand(B, T, generator=g) > 0.25).float(),
        rollout=old + torch.randn(B, T, generator=g) * 0.5,
        ref=old + torch.randn(B, T, generator=g) * 0.3,
        ent=torch.rand(B, T, generator=g),
        ratio_ref=torch.exp(lp - old + torch.randn(B, T, generator=g) * 0.1),
    )
    if seed % 3 == 0:
        batch["mask"][1] = 0.0  # an empty response: left out of the sequence count
    batch["mask"][0, 0] = 1.0  # never an all-masked batch
    return batch


MODES = ("vanilla", "gspo", "gspo_token", "cispo", "reinforce", "dro")
AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@st.composite
def _specs(draw):
    mode = draw(st.sampled_from(MODES))
    force = draw(st.booleans())
    kw = dict(clip_low=0.0 if mode == "cispo" and draw(st.booleans()) else L,
              clip_high=draw(st.sampled_from([H, 1.28])), loss_mode=mode, loss_agg_mode=draw(st.sampled_from(AGG)),
              force_on_policy_ratio=force)
    if mode in ("vanilla", "gspo", "gspo_token") and draw(st.booleans()):
        kw["eps_clip_c"] = C
    if draw(st.booleans()):
        kw.update(use_tis=True, tis_mode=draw(st.sampled_from(["truncate", "icepop"])),
                  tis_level=draw(st.sampled_from(["token", "sequence", "geo_mean"])),
                  tis_clip=1.5, tis_clip_low=draw(st.sampled_from([0.0, 0.5])), icepop_low=0.6, icepop_high=1.6)
    if not force and draw(st.booleans()):
        kw.update(rollout_rs="token_k1", rollout_rs_threshold=1.5,
                  rollout_rs_threshold_low=draw(st.sampled_from([None, 0.9])))
    if mode == "dro":
        kw["dro_beta"] = 0.7
    kw.update(kl_loss_type=draw(st.sampled_from(["k1", "k2", "k3"])), kl_loss_coef=draw(st.sampled_from([0.0, 0.1])),
              entropy_coef=draw(st.sampled_from([0.0, 0.02])))
    if draw(st.booleans()):
        kw.update(ref_clip_low=0.75, ref_clip_high=1.3)
    return LossSpec(**kw)


def _run(batch, spec, with_rollout, with_ref, with_ent, with_ratio_ref):
    lp = batch["lp"].clone().requires_grad_()
    rollout = batch["rollout"] if with_rollout or spec.use_tis or spec.rollout_rs else None
    ref = batch["ref"] if with_ref or spec.kl_loss_coef else None
    ent = batch["ent"] if with_ent or spec.entropy_coef else None
    ratio_ref = batch["ratio_ref"] if with_ratio_ref else None
    # the denominator over the kept tokens, as the loop counts it (loss_mask, then loss_denominator)
    kept = loss_mask(batch["mask"], batch["old"], rollout, spec.rollout_rs, spec.rollout_rs_threshold,
                     spec.rollout_rs_threshold_low)
    denom = loss_denominator(kept, spec.loss_agg_mode)
    old = None if spec.force_on_policy_ratio else batch["old"]
    loss, metrics = policy_loss(lp, old, batch["adv"], batch["mask"], spec, denominator=denom,
                                rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent, ratio_ref=ratio_ref)
    (grad,) = torch.autograd.grad(loss, lp)
    expected = _reference(*(None if x is None else x.tolist() for x in (
        batch["lp"], batch["old"], batch["adv"], batch["mask"], rollout, ref, ent, ratio_ref)), spec)
    return (loss.item(), grad, reduce_metrics([metrics])), expected


@settings(max_examples=120, deadline=None, derandomize=True)  # float32 vs float64 near a bound: fixed draws
@given(_specs(), st.integers(0, 2**16), st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_loss_gradient_and_every_metric_match_the_token_by_token_reference(spec, seed, rollout, ref, ent, ratio_ref):
    (loss, grad, metrics), (exp_loss, exp_grad, exp_metrics) = _run(_batch(seed), spec, rollout, ref, ent, ratio_ref)
    assert loss == pytest.approx(exp_loss, rel=1e-5, abs=1e-6)
    assert grad.tolist() == [pytest.approx(row, rel=1e-4, abs=1e-6) for row in exp_grad]
    assert metrics.keys() == exp_metrics.keys()
    for key, value in exp_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key


def test_the_loss_metric_is_the_returned_loss_when_the_denominator_is_the_global_count():
    batch = _batch(3)  # row 1 empty
    for agg in AGG:
        spec = LossSpec(clip_low=L, clip_high=H, loss_agg_mode=agg, use_tis=True, kl_loss_coef=0.1)
        (loss, _, metrics), _ = _run(batch, spec, True, True, False, False)
        assert metrics["loss"] == pytest.approx(loss, rel=1e-6)


def test_token_weights_for_calibration_are_the_factors_the_loss_applies_under_rejection_and_sequence_tis():
    """loss_token_weights (what Calibrated Clipping weighs tokens by) against the reference's factor:
    the loss of a vanilla surrogate with every ratio 1 inside the clip is -sum_t w_t A_t / denominator."""
    batch = _batch(5)
    kw = dict(use_tis=True, rollout_rs="token_k1", rollout_rs_threshold=1.5)
    tis = dict(mode="icepop", level="sequence", icepop_low=0.6, icepop_high=1.6)
    for agg in AGG:
        spec = LossSpec(clip_low=0.01, clip_high=100.0, loss_agg_mode=agg, tis_mode="icepop", tis_level="sequence",
                        icepop_low=0.6, icepop_high=1.6, **kw)
        w = loss_token_weights(batch["mask"], agg, batch["old"], batch["rollout"], **kw, **tis)
        # a loss that is -A per token at ratio 1: feed the old log-probs as the current ones
        loss, _ = policy_loss(batch["old"], batch["old"], batch["adv"], batch["mask"], spec, denominator=1.0,
                              rollout_logprobs=batch["rollout"])
        assert loss.item() == pytest.approx(-(w * batch["adv"]).sum().item(), rel=1e-5)
        kept = loss_mask(batch["mask"], batch["old"], batch["rollout"], "token_k1", 1.5)
        assert not bool((w[~kept] != 0).any()) and bool((~kept & batch["mask"].bool()).any())


def test_a_clipped_token_exactly_on_a_bound_keeps_its_gradient_and_is_not_counted():
    # ratio exactly L (A<0) and exactly H (A>0) and exactly c (A<0, dual-clip): ties do not clip
    ratios = torch.tensor([[0.75, 1.25, 4.0, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 2.0, -1.0, -1.0]], dtype=torch.float64)
    lp = torch.log(ratios).requires_grad_()
    spec = LossSpec(clip_low=0.75, clip_high=1.25, eps_clip_c=4.0)
    loss, metrics = policy_loss(lp, torch.zeros_like(lp), adv, torch.ones_like(lp), spec, denominator=4.0)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0].tolist() == pytest.approx([0.75 / 4, -2 * 1.25 / 4, 4.0 / 4, 0.0])
    m = reduce_metrics([metrics])
    assert (m["clip/low_neg"], m["clip/high_pos"], m["clip/dual"], m["pg_clipfrac"]) == (1 / 3, 0.0, 0.0, 1 / 4)
