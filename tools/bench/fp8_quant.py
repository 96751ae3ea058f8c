"""Benchmark: FP8 quantizer throughput per granularity against a plain copy of the same tensor.

Prints one JSON object. For each granularity: seconds (median of --repeats, after a warm-up),
gbps = (bytes read + FP8 bytes written + scale bytes written) / seconds, and two ratios against
`x.clone()` of the same tensor timed in the same run (gbps = 2 * bytes / seconds):
- ratio_vs_copy = copy_seconds / quantize_seconds (elements per second, quantize vs copy);
- bandwidth_ratio = gbps / copy_gbps (bytes per second; a quantizer writes 1 byte per element
  where a copy writes the input's 2-4, so this is the smaller number).

Usage: OMP_NUM_THREADS=1 python tools/bench/fp8_quant.py [--rows 4096 --cols 4096 --dtype bf16]
"""

import argparse
import json
import statistics
import time

import torch

from megatron_rl.fp8 import GRANULARITIES, quantize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def time_call(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench(rows: int, cols: int, dtype: torch.dtype, repeats: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(rows, cols, dtype=dtype)
    in_bytes = x.numel() * x.element_size()
    copy_s = time_call(lambda: x.clone(), repeats)
    copy_gbps = 2 * in_bytes / copy_s / 1e9
    results = {}
    for granularity in GRANULARITIES:
        q, s = quantize(x, granularity)
        moved = in_bytes + q.numel() * q.element_size() + s.numel() * s.element_size()
        seconds = time_call(lambda: quantize(x, granularity), repeats)
        gbps = moved / seconds / 1e9
        results[granularity] = {
            "seconds": seconds,
            "gbps": round(gbps, 3),
            "ratio_vs_copy": round(copy_s / seconds, 3),
            "bandwidth_ratio": round(gbps / copy_gbps, 3),
        }
    return {
        "shape": [rows, cols],
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "copy": {"seconds": copy_s, "gbps": round(copy_gbps, 3)},
        "quantize": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(json.dumps(bench(args.rows, args.cols, DTYPES[args.dtype], args.repeats), indent=2))


if __name__ == "__main__":
    main()
