"""Benchmark the actor's train step on CPU: time and peak RSS, FP32 vs BF16 parameters, activation
recompute off vs full, as JSON with ratios against FP32 / no recompute measured in the same run.

Each configuration runs in its own process (so its peak RSS is its own) on the same random
Qwen2-style model and batch; the step time is the median over the timed steps after a warm-up,
in process CPU time (single-threaded: robust on a shared machine), wall time alongside.

examples:
  python tools/bench/actor_step.py
  python tools/bench/actor_step.py --hidden 512 --layers 4 --seq 512 --steps 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import tempfile
import time

CONFIGS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"),
           "fp32_recompute": ("fp32", "full"), "bf16_recompute": ("bf16", "full")}


def _batch(args):
    import torch

    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(args.batch, args.seq)
    mask[:, args.seq // 4:] = 1.0
    return {"tokens": torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
            "loss_mask": mask, "advantages": torch.randn(args.batch, args.seq, generator=gen)}


def _loss_fn(denominator: float):
    import torch

    def loss_fn(logprobs, entropy, mb):
        total = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
        return total / denominator, {"pg": torch.stack([total.detach().double(),
                                                        mb["loss_mask"].sum().double()])}

    return loss_fn


def _child(name: str, args, hf_dir: str, queue) -> None:
    import dataclasses

    import torch

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.parallel import init_parallel
    from megatron_rl.actor.quiet import megatron_quiet
    from megatron_rl.actor.settings import plain_settings

    torch.set_num_threads(args.threads)
    dtype, recompute = CONFIGS[name]
    settings = dataclasses.replace(plain_settings(params_dtype=dtype),
                                   recompute_granularity=recompute)
    with megatron_quiet():
        actor = MegatronActor.build(hf_dir, parallel=init_parallel(1, 1), lr=1e-5, settings=settings)
    batch = _batch(args)
    loss_fn = _loss_fn(float(batch["loss_mask"].sum()))
    cpu, wall = [], []
    for _ in range(args.warmup + args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        actor.train_step(batch, loss_fn, micro_batch_size=args.micro_batch)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    queue.put({"step_cpu_s": statistics.median(cpu[args.warmup:]),
               "step_wall_s": statistics.median(wall[args.warmup:]), "peak_rss_mb": peak_mb})


def _measure(name: str, args, hf_dir: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, args, hf_dir, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from megatron_rl.models.tiny import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as hf_dir:
        heads = max(args.hidden // 64, 2)
        make_tiny_hf_model("qwen2", hf_dir, hidden_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=heads, num_key_value_heads=heads // 2,
                           intermediate_size=4 * args.hidden, vocab_size=args.vocab,
                           max_position_embeddings=max(args.seq, 512))
        results = {name: _measure(name, args, hf_dir) for name in CONFIGS}
    base, base_rc = results["fp32"], results["fp32_recompute"]
    bf16, bf16_rc = results["bf16"], results["bf16_recompute"]
    ratios = {
        "bf16_vs_fp32_step_cpu": bf16["step_cpu_s"] / base["step_cpu_s"],
        "bf16_vs_fp32_peak_rss": bf16["peak_rss_mb"] / base["peak_rss_mb"],
        "recompute_vs_none_step_cpu": base_rc["step_cpu_s"] / base["step_cpu_s"],
        "recompute_vs_none_peak_rss": base_rc["peak_rss_mb"] / base["peak_rss_mb"],
        "bf16_recompute_vs_bf16_step_cpu": bf16_rc["step_cpu_s"] / bf16["step_cpu_s"],
        "bf16_recompute_vs_bf16_peak_rss": bf16_rc["peak_rss_mb"] / bf16["peak_rss_mb"],
    }
    print(json.dumps({"args": vars(args), "results": results,
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}}, indent=1))


if __name__ == "__main__":
    main()
