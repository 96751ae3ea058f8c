"""DP=2 over gloo gives the loss, gradients, metrics and calibrated (L, H) of one process on the whole batch."""

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.algo.calibrated_clip import CalibratedClipController, calibrate_bounds
from megatron_rl.algo.metrics import reduce_metrics
from megatron_rl.algo.policy_loss import LossSpec, loss_denominator, policy_loss

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# Uneven shards (rank 0: 3 sequences in micro-batches of 1 + 2, rank 1: 9 in 4 + 5), so a mean of
# per-rank means would differ from the global mean.
SHARDS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 7), slice(7, 12)]}
LOSS_KW = dict(clip_low=0.8, clip_high=1.28, eps_clip_c=3.0, use_tis=True, kl_loss_coef=0.05, entropy_coef=0.01,
               ref_clip_low=0.8, ref_clip_high=1.28)


def _batch():
    g = torch.Generator().manual_seed(123)
    shape = (12, 16)
    old = -torch.rand(shape, generator=g) * 2
    lp = old + torch.randn(shape, generator=g) * 0.3
    lengths = torch.randint(1, 17, (12,), generator=g)
    lengths[5] = 0  # one empty response
    batch = dict(
        logprobs=lp, old_logprobs=old,
        advantages=torch.randn(12, 1, generator=g).expand(shape).contiguous(),
        mask=(torch.arange(16) < lengths[:, None]).float(),
        rollout_logprobs=old + torch.randn(shape, generator=g) * 0.2,
        ref_logprobs=old + torch.randn(shape, generator=g) * 0.1,
        entropy=torch.rand(shape, generator=g),
        ratio_ref=torch.exp(lp - old + torch.randn(shape, generator=g) * 0.05),
    )
    calib = torch.randn(12, 400, generator=g) * 0.15
    batch["calib"] = ((calib + torch.randn(12, 400, generator=g) * 0.06 - 0.02).exp(), calib.exp(),
                      torch.randn(12, 400, generator=g), (torch.rand(12, 400, generator=g) > 0.1).float())
    return batch


def _run(batch, micro_batches, reduce=None):
    """Loss, grad of logprobs, reduced metrics per mode; calibrated bounds; all over `micro_batches`."""
    out = {}
    lp = batch["logprobs"].clone().requires_grad_()
    for mode in MODES:
        denom = loss_denominator([batch["mask"][s] for s in micro_batches], mode, reduce)
        losses, metrics = [], []
        for s in micro_batches:
            args = {k: batch[k][s] for k in ("old_logprobs", "advantages", "mask")}
            kw = {k: batch[k][s] for k in ("rollout_logprobs", "ref_logprobs", "entropy", "ratio_ref")}
            loss, m = policy_loss(lp[s], **args, spec=LossSpec(loss_agg_mode=mode, **LOSS_KW), denominator=denom,
                                  **kw)
            losses.append(loss)
            metrics.append(m)
        total = torch.stack(losses).sum()
        (grad,) = torch.autograd.grad(total, lp)
        out[mode] = (total.item(), grad, reduce_metrics(metrics, reduce), reduce_metrics(metrics))
    ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28, num_bins=1024)
    hist = ctrl.new_histogram()
    for s in micro_batches:
        hist.add(*(t[s] for t in batch["calib"]))
    out["calib_metrics"] = ctrl.update_from_histogram(hist, reduce)
    out["bounds"] = ctrl.bounds
    r8, r16, adv, mask = (t[micro_batches[0].start : micro_batches[-1].stop] for t in batch["calib"])
    out["calibrate_bounds"] = calibrate_bounds(r8, r16, adv, mask, 0.2, 0.28, num_bins=1024, reduce=reduce)
    return out


def _all_reduce_sum(t):
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # default group = the DP group of this 2-rank world
    return t


def _worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        torch.save(_run(_batch(), SHARDS[rank], _all_reduce_sum), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(out_dir, world_size=2, timeout_s=90.0):
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.spawn(_worker, args=(world_size, _free_port(), str(out_dir)), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"DP workers did not finish within {timeout_s} s")


@pytest.mark.timeout(180)
def test_dp2_equals_one_process_on_the_global_batch(tmp_path):
    _spawn(tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = _run(_batch(), [slice(0, 12)])
    for mode in MODES:
        loss, grad, metrics, _ = single[mode]
        assert sum(r[mode][0] for r in ranks) == pytest.approx(loss, rel=1e-6), mode
        dp_grad = sum(r[mode][1] for r in ranks)  # each rank's grad is zero outside its rows
        assert torch.allclose(dp_grad, grad, atol=1e-7), mode
        for r in ranks:
            assert r[mode][2].keys() == metrics.keys()
            for key, value in metrics.items():
                assert r[mode][2][key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), (mode, key)
        # the test would see a mean of per-rank means: it differs here
        naive = (ranks[0][mode][3]["pg_loss"] + ranks[1][mode][3]["pg_loss"]) / 2
        assert abs(naive - metrics["pg_loss"]) > 1e-3
    assert ranks[0]["bounds"] == ranks[1]["bounds"]  # bitwise identical on every rank
    assert ranks[0]["calibrate_bounds"] == ranks[1]["calibrate_bounds"]
    assert ranks[0]["bounds"] == pytest.approx(single["bounds"], rel=1e-9)
    assert ranks[0]["calibrate_bounds"] == pytest.approx(single["calibrate_bounds"], rel=1e-9)
    assert ranks[0]["bounds"] != (0.8, 1.28)  # the calibration really moved the bounds
    assert ranks[0]["calib_metrics"]["calib/tokens"] == single["calib_metrics"]["calib/tokens"]
