"""DP=2 over gloo equals one process for the sequence-level pieces: GSPO's loss and gradient,
sequence-level Calibrated Clipping's (L, H), and REINFORCE++'s global-batch advantage whitening."""

import pytest
import torch
from _launch import run_distributed

# Uneven shards: rank 0 holds 3 sequences (micro-batches 1 + 2), rank 1 holds 9 (4 + 5).
SHARDS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 7), slice(7, 12)]}
GROUPS = {0: slice(0, 4), 1: slice(4, 12)}  # reward groups of 4 samples: rank 0 one group, rank 1 two


def _batch():
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(12, 16, generator=g) * 2
    lengths = torch.randint(1, 17, (12,), generator=g)
    lengths[5] = 0  # an empty response
    mask = (torch.arange(16) < lengths[:, None]).float()
    return dict(
        logprobs=old + torch.randn(12, 16, generator=g) * 2e-3, old_logprobs=old, mask=mask,
        advantages=torch.randn(12, 1, generator=g).expand(12, 16).contiguous(),
        rollout_logprobs=old + torch.randn(12, 16, generator=g) * 0.05,
        log_ratio_ref=torch.randn(12, 16, generator=g) * 3e-3,
        rewards=torch.randint(0, 2, (12,), generator=g).float(), lengths=lengths,
    )


def _run(batch, micro_batches, groups, reduce=None):
    from megatron_rl.algo.advantages import reinforce_baseline_advantages
    from megatron_rl.algo.calibrated_clip import CalibratedClipController
    from megatron_rl.algo.calib_solve import Rules
    from megatron_rl.algo.metrics import reduce_metrics
    from megatron_rl.algo.policy_loss import LossSpec, loss_denominator, loss_token_weights, policy_loss

    lp = batch["logprobs"].clone().requires_grad_()
    denom = loss_denominator([batch["mask"][s] for s in micro_batches], "seq-mean-token-mean", reduce)
    rules = Rules(low_min=0.99, high_max=1.01, alpha_tolerance=0.0, alpha_tolerance_tokens=0.0)
    ctrl = CalibratedClipController(3e-4, 4e-4, log_ratio_range=0.01, rules=rules)
    hist = ctrl.new_histogram()
    losses, metrics = [], []
    for s in micro_batches:
        old, mask, rollout = batch["old_logprobs"][s], batch["mask"][s], batch["rollout_logprobs"][s]
        kw = dict(use_tis=True, tis_level="sequence", tis_clip=2.0)
        spec = LossSpec(clip_low=1 - 3e-4, clip_high=1 + 4e-4, loss_agg_mode="seq-mean-token-mean",
                        loss_mode="gspo", **kw)
        loss, m = policy_loss(lp[s], old, batch["advantages"][s], mask, spec, denominator=denom,
                              rollout_logprobs=rollout)
        losses.append(loss)
        metrics.append(m)
        weights = loss_token_weights(mask, "seq-mean-token-mean", old, rollout, use_tis=True, level="sequence",
                                     tis_clip=2.0)
        hist.add_sequences((lp[s] - old).detach() * mask, batch["log_ratio_ref"][s], batch["advantages"][s], mask,
                           weights=weights)
    total = torch.stack(losses).sum()
    (grad,) = torch.autograd.grad(total, lp)
    calib = ctrl.update_from_histogram(hist, reduce)
    adv = reinforce_baseline_advantages(batch["rewards"][groups], 4, batch["lengths"][groups].float(), reduce=reduce)
    return {"loss": total.item(), "grad": grad, "metrics": reduce_metrics(metrics, reduce), "bounds": ctrl.bounds,
            "calib": calib, "adv": adv}


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")

    def all_reduce_sum(t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # default group = the DP group of this 2-rank world
        return t

    out = _run(_batch(), SHARDS[rank], GROUPS[rank], all_reduce_sum)
    rows = slice(SHARDS[rank][0].start, SHARDS[rank][-1].stop)
    out["grad"] = out["grad"][rows]
    return out


def test_dp2_equals_one_process_for_gspo_sequence_calibration_and_reinforce_baseline():
    one = _run(_batch(), [slice(0, 12)], slice(0, 12))
    r0, r1 = run_distributed(_worker, world_size=2, timeout_s=300)
    for r in (r0, r1):
        assert r["loss"] + (r1 if r is r0 else r0)["loss"] == pytest.approx(one["loss"], rel=1e-6)
        assert r["bounds"] == one["bounds"]  # bitwise: same reduced histogram, same solve
        for key, value in one["metrics"].items():
            assert r["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), key
        for key in ("calib/alpha", "calib/tokens", "calib/low_raw", "calib/high_raw"):
            assert r["calib"][key] == pytest.approx(one["calib"][key], rel=1e-12, nan_ok=True), key
    assert torch.allclose(torch.cat([r0["grad"], r1["grad"]]), one["grad"], atol=1e-7)
    assert torch.allclose(torch.cat([r0["adv"], r1["adv"]]), one["adv"], atol=1e-6)
    assert one["calib"]["calib/tokens"] == 11  # sequences with a response token, not tokens
    assert one["calib"]["calib/skipped"] == 0.0 and one["calib"]["calib/alpha"] > 0 and one["bounds"][0] != 1 - 3e-4
