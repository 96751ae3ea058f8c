"""The calibration histogram of a real step, rebuilt token by token from the dumped calibration
mini-batch with the loss's weights computed here by hand (TIS truncation, sequence aggregation): a
swapped log-prob pair or a wrong weight in the loop's histogram moves a bin and fails."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from test_rl_loop import EXAMPLES, TINY

ROOT = EXAMPLES.parents[1]


def rebuild(dump: dict) -> dict[str, torch.Tensor]:
    """neg_count, pos_count, neg_ref_kept, by a plain loop over the tokens."""
    algo, nb, rng = dump["algo"], dump["num_bins"], dump["log_ratio_range"]
    width = 2.0 * rng / nb
    out = {k: torch.zeros(nb, dtype=torch.float64) for k in ("neg_count", "pos_count", "neg_ref_kept")}
    names = dump["input_names"]
    for x in dump["micro_batches"]:
        lp, old, roll, rref, adv, mask = (x[names.index(k)].double() for k in
                                          ("logprobs", "old_logprobs", "rollout_logprobs", "ratio_ref", "advantages",
                                           "loss_mask"))
        for b in range(lp.shape[0]):
            kept = [t for t in range(lp.shape[1]) if mask[b, t] > 0]
            for t in kept:
                w = min(math.exp(old[b, t] - roll[b, t]), algo["tis_clip"]) if algo["use_tis"] else 1.0
                if algo["loss_agg_mode"] == "seq-mean-token-mean":
                    w /= len(kept)
                i = min(max(math.floor((float(lp[b, t] - old[b, t]) + rng) / width), 0), nb - 1)
                if adv[b, t] < 0:
                    out["neg_count"][i] += w
                    if rref[b, t] >= 1.0 - dump["eps_low"]:
                        out["neg_ref_kept"][i] += w
                elif adv[b, t] > 0:
                    out["pos_count"][i] += w
    return out


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_dumped_histogram_equals_the_one_rebuilt_from_its_mini_batch(tmp_path, agg):
    from megatron_rl.algo.ratio_histogram import HISTOGRAMS

    cmd = [sys.executable, "-m", "megatron_rl.train", str(EXAMPLES / "fp8_calibrated.yaml"), *TINY,
           "train.num_steps=1", "calib.period=1", f"algo.loss_agg_mode={agg}", "algo.tis_clip=1.02",
           "eval.datasets=[]", "eval.at_start=false", "eval.at_end=false", "checkpoint.save_every=0",
           "checkpoint.keep_best=", f"log.dir={tmp_path / 'run'}", f"calib.dump_dir={tmp_path / 'calib'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    dump = torch.load(tmp_path / "calib" / "calib_000000.pt", weights_only=False)
    assert dump["algo"]["loss_agg_mode"] == agg and dump["micro_batches"]
    assert torch.equal(dump["local_payload"], dump["payload"])  # one rank: nothing to all-reduce
    want = rebuild(dump)
    nb = dump["num_bins"]
    assert want["neg_count"].sum() > 0 and want["pos_count"].sum() > 0
    for name, expected in want.items():
        got = dump["payload"][HISTOGRAMS.index(name) * nb:(HISTOGRAMS.index(name) + 1) * nb]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9, msg=name)  # the loop weighs in FP32
