"""Benchmark the trainer -> engine weight export: throughput (GB/s) and peak extra memory, as JSON.

Builds a random Qwen2-style actor (~100M parameters by default) on the CPU and streams its weights
through the sync pipeline (TP gather, HF names, FP8 blockwise quantization, buckets) into a sink
that keeps nothing. Baseline in the same run: a plain copy of every parameter.

examples:
  python tools/bench/weight_sync.py
  python tools/bench/weight_sync.py --hidden 512 --layers 8 --bucket-mb 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import psutil
import torch


class PeakRSS:
    """Samples this process's RSS every 5 ms in a thread; `peak` is the max seen."""

    def __init__(self) -> None:
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


class NullTransport:
    """Receives buckets and drops them: measures the sender side only."""

    def begin(self, version):
        pass

    def send(self, bucket, version):
        pass

    def finish(self, version):
        pass

    def checksums(self, names):
        return {}


def build_actor(args):
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.parallel import init_parallel
    from megatron_rl.models.tiny import make_tiny_hf_model

    folder = tempfile.mkdtemp()
    make_tiny_hf_model("qwen2", folder, vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256))
    actor = MegatronActor.build(folder, parallel=init_parallel(1, 1))
    actor.load_hf(folder)
    return actor


def timed(fn) -> tuple[float, float]:
    with PeakRSS() as rss:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, rss.extra_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    args = parser.parse_args()
    from megatron_rl.fp8.rollout_quant import RolloutQuantSpec
    from megatron_rl.sync.weight_sync import WeightSync

    actor = build_actor(args)
    params = [p for chunk in actor.model for p in chunk.parameters()]
    num_params = sum(p.numel() for p in params)
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    out = {"num_params": num_params, "model_mb": model_bytes / 2**20, "bucket_mb": args.bucket_mb}
    copy_s, copy_mb = timed(lambda: [p.detach().clone() for p in params])
    out.update(copy_s=copy_s, copy_gb_per_s=model_bytes / copy_s / 1e9, copy_peak_extra_mb=copy_mb)
    for quant in ("bf16", "fp8_blockwise"):
        sync = WeightSync(actor, NullTransport(), RolloutQuantSpec(rollout_quant=quant), bucket_mb=args.bucket_mb)
        seconds, extra = timed(sync.sync)
        out[quant] = {"seconds": seconds, "gb_per_s": model_bytes / seconds / 1e9,
                      "ratio_vs_copy": copy_s / seconds, "peak_extra_mb": extra,
                      "peak_extra_over_model": extra * 2**20 / model_bytes}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
