"""Benchmark: Calibrated Clipping cost against the plain PPO loss on the same tensors; prints JSON.

Reports, per token count: seconds for the PPO loss forward and forward+backward, for one
calibration (histogram fill + solve), their ratios, and the all-reduce payload in bytes (fixed by
num_bins, not by tokens). At the smallest size it also measures the histogram error against an
exact sort-based reference: |log L - log L_exact| and |log H - log H_exact| in bin widths, and the
relative error of the matched balance.

    OMP_NUM_THREADS=1 python tools/bench/calibrated_clip.py --tokens 1000000 16000000
(with the package installed, `pip install -e .`, or PYTHONPATH=. from the repository root)
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from megatron_rl.algo.calib_solve import Rules
from megatron_rl.algo.calibrated_clip import CalibratedClipController, calibrate_bounds
from megatron_rl.algo.policy_loss import LossSpec, policy_loss

SEQ_LEN = 1024


def make_batch(num_tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Synthetic GRPO-like batch [num_tokens / SEQ_LEN, SEQ_LEN]: BF16 ratios plus biased FP8 noise."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_tokens // SEQ_LEN, SEQ_LEN)
    old = -torch.rand(shape, generator=g) * 3
    log16 = torch.randn(shape, generator=g) * 0.15
    log8 = log16 + torch.randn(shape, generator=g) * 0.06 - 0.02
    lengths = torch.randint(SEQ_LEN // 4, SEQ_LEN + 1, (shape[0], 1), generator=g)
    return {
        "old": old,
        "logprobs": old + log8,
        "ratio_fp8": log8.exp(),
        "ratio_ref": log16.exp(),
        "advantages": torch.randn(shape[0], 1, generator=g).expand(shape).contiguous(),
        "mask": (torch.arange(SEQ_LEN) < lengths).float(),
    }


def best_of(fn, repeats: int) -> float:
    """Fastest wall time of `repeats` calls, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def time_sizes(num_tokens: int, num_bins: int, repeats: int) -> dict[str, float | int]:
    b = make_batch(num_tokens)
    denom = float(b["mask"].sum())
    lp = b["logprobs"].clone().requires_grad_()

    def ppo_forward():
        with torch.no_grad():
            policy_loss(lp, b["old"], b["advantages"], b["mask"], LossSpec(clip_low=0.8, clip_high=1.28),
                        denominator=denom)

    def ppo_forward_backward():
        loss, _ = policy_loss(lp, b["old"], b["advantages"], b["mask"], LossSpec(clip_low=0.8, clip_high=1.28),
                              denominator=denom)
        loss.backward()

    def calibrate():
        ctrl = CalibratedClipController(eps_low=0.2, eps_high=0.28, num_bins=num_bins)
        ctrl.update(b["ratio_fp8"], b["ratio_ref"], b["advantages"], b["mask"])

    ppo_f, ppo_fb, calib = (best_of(f, repeats) for f in (ppo_forward, ppo_forward_backward, calibrate))
    hist = CalibratedClipController(num_bins=num_bins).new_histogram()
    return {
        "tokens": num_tokens,
        "valid_tokens": int(denom),
        "ppo_loss_fwd_s": round(ppo_f, 4),
        "ppo_loss_fwd_bwd_s": round(ppo_fb, 4),
        "calibration_s": round(calib, 4),
        "calibration_over_ppo_fwd": round(calib / ppo_f, 3),
        "calibration_over_ppo_fwd_bwd": round(calib / ppo_fb, 3),
        "allreduce_payload_bytes": hist.payload_bytes(),
    }


def exact_bounds(b: dict[str, torch.Tensor], low: float, eps_low: float, eps_high: float) -> tuple[float, float, float]:
    """Sort-based: the exact alpha-quantile L, the exact H given `low`, and the BF16 balance p16."""
    v = b["mask"].bool()
    r8, r16, adv = (b[k][v].double() for k in ("ratio_fp8", "ratio_ref", "advantages"))
    neg, pos = adv < 0, adv > 0
    m = int((r16[neg] < 1 - eps_low).sum())
    low_exact = r8[neg].sort().values[m].item()
    w16, w8 = adv.abs() * r16, adv.abs() * r8
    p16 = (w16[pos & (r16 <= 1 + eps_high)].sum() / w16[neg & (r16 >= 1 - eps_low)].sum()).item()
    target = p16 * w8[neg & (r8 >= low)].sum().item()
    order = r8[pos].argsort()
    j = int((w8[pos][order].cumsum(0) < target).sum())
    high_exact = r8[pos][order][j].item() if j < len(order) else math.inf
    return low_exact, high_exact, p16


def histogram_error(num_tokens: int, num_bins: int) -> dict[str, float]:
    b = make_batch(num_tokens, seed=1)
    # the bare rule (no tolerance, no range, the |A| r balance) is what the sort-based reference computes
    bare = Rules(low_min=0.05, high_max=50.0, alpha_tolerance=0.0, alpha_tolerance_tokens=0.0, balance="abs_adv_ratio")
    low, high = calibrate_bounds(b["ratio_fp8"], b["ratio_ref"], b["advantages"], b["mask"], 0.2, 0.28,
                                 num_bins=num_bins, rules=bare)
    low_exact, high_exact, p16 = exact_bounds(b, low, 0.2, 0.28)
    width = 2 * 2.0 / num_bins
    v = b["mask"].bool()
    r8, adv = b["ratio_fp8"][v].double(), b["advantages"][v].double()
    w = adv.abs() * r8
    balance = (w[(adv > 0) & (r8 <= high)].sum() / w[(adv < 0) & (r8 >= low)].sum()).item()
    return {
        "tokens": num_tokens,
        "num_bins": num_bins,
        "bin_width_log": width,
        "low": low,
        "high": high,
        "low_error_bins": abs(math.log(low) - math.log(low_exact)) / width,
        "high_error_bins": abs(math.log(high) - math.log(high_exact)) / width,
        "balance_rel_error": abs(balance / p16 - 1.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 16_000_000])
    parser.add_argument("--num-bins", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = {
        "torch_threads": torch.get_num_threads(),
        "num_bins": args.num_bins,
        "sizes": [time_sizes(n, args.num_bins, args.repeats) for n in args.tokens],
        "histogram_error": [histogram_error(min(args.tokens), nb) for nb in (256, args.num_bins)],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
