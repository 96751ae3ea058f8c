"""Benchmark: packed vs padded micro-batches (train tokens/s) and chunked vs whole log-probs (peak
memory), as ratios measured in the same run; prints JSON.

1. A tiny CPU actor trains on one batch of sequences with a long-tailed length spread (log-normal,
   like RL responses: most short, a few near the maximum), once as padded rows of
   `--micro-batch-size` and once packed to `--budget` tokens. Reported: real (non-padding)
   tokens per second of each, their ratio, and the computed-token overhead of each layout.
2. The log-prob / entropy kernel forward + backward on [--seq, --vocab] FP32 logits, whole and in
   chunks of --chunk rows, each in a fresh process: peak RSS above the logits themselves, the
   ratio, and what the planner (megatron_rl/cluster/memory.py) predicts for each.

    OMP_NUM_THREADS=1 python tools/bench/packing.py
(with the package installed, `pip install -e .`, or PYTHONPATH=. from the repository root)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
import time

import torch

from megatron_rl.actor.packing import pack_batch, sequence_lengths


def long_tail_batch(num: int, max_len: int, seed: int = 0) -> dict:
    """Prompt (16 tokens) + response rows; response lengths log-normal, capped at max_len."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(num, generator=gen) * 0.9 + 4.2).exp().clamp(8, max_len - 16).long() + 16
    tokens = torch.randint(1, 128, (num, max_len), generator=gen)
    mask = torch.zeros(num, max_len)
    for row, length in enumerate(lengths.tolist()):
        tokens[row, length:] = 0
        mask[row, 16:length] = 1.0
    return {"tokens": tokens, "loss_mask": mask, "advantages": torch.randn(num, 1, generator=gen) * mask}


def _loss_fn(denominator: float):
    def loss_fn(logprobs, entropy, mb):
        m = mb["loss_mask"]
        total = -(logprobs * mb["advantages"] * m).sum()
        return total / denominator, {"n": torch.stack([total.detach().double(), m.sum().double()])}
    return loss_fn


def bench_packing(args) -> dict:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.parallel import init_parallel
    from megatron_rl.models.tiny import make_tiny_hf_model

    hf_dir = tempfile.mkdtemp()
    make_tiny_hf_model("qwen2", hf_dir, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_hidden_layers=2, vocab_size=128, max_position_embeddings=args.max_len)
    parallel = init_parallel(1, 1)
    batch = long_tail_batch(args.num_seqs, args.max_len)
    real = int(sequence_lengths(batch["loss_mask"]).sum())
    packed, _ = pack_batch(batch, args.budget, 16)
    layouts = {"padded": (batch, args.micro_batch_size), "packed": (packed, 1)}
    out = {"num_seqs": args.num_seqs, "real_tokens": real}
    loss_fn = _loss_fn(float(batch["loss_mask"].sum()))
    for name, (actor_batch, mbs) in layouts.items():
        actor = MegatronActor.build(hf_dir, parallel=parallel, lr=1e-4)
        actor.train_step(actor_batch, loss_fn, micro_batch_size=mbs, logprob_chunk_size=256)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            actor.train_step(actor_batch, loss_fn, micro_batch_size=mbs, logprob_chunk_size=256)
            times.append(time.perf_counter() - start)
        out[f"{name}_tokens_per_s"] = real / min(times)
        out[f"{name}_computed_tokens"] = int(actor_batch["tokens"].numel())
    out["packed_over_padded_speedup"] = out["packed_tokens_per_s"] / out["padded_tokens_per_s"]
    return out


def _kernel_peak(chunk: int, seq: int, vocab: int, queue) -> None:
    """Peak RSS (bytes) of one forward + backward above the resident logits, in this process."""
    from megatron_rl.actor.logprobs import chunked_logprobs_and_entropy, vocab_parallel_logprobs_and_entropy

    torch.set_num_threads(1)
    logits = torch.randn(seq, vocab).requires_grad_()
    targets = torch.randint(0, vocab, (seq,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if chunk:
        lp, ent = chunked_logprobs_and_entropy(logits, torch.arange(seq), targets, chunk)
    else:
        lp, ent = vocab_parallel_logprobs_and_entropy(logits[None], targets[None])
    (lp.sum() + 0.1 * ent.sum()).backward()
    queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)


def bench_logprobs(args) -> dict:
    ctx = mp.get_context("spawn")
    out = {"seq": args.seq, "vocab": args.vocab, "chunk": args.chunk,
           "logits_bytes": args.seq * args.vocab * 4}
    for name, chunk in (("whole", 0), ("chunked", args.chunk)):
        queue = ctx.Queue()
        proc = ctx.Process(target=_kernel_peak, args=(chunk, args.seq, args.vocab, queue))
        proc.start()
        out[f"{name}_peak_extra_bytes"] = queue.get(timeout=600)
        proc.join()
    out["chunked_over_whole_peak"] = out["chunked_peak_extra_bytes"] / out["whole_peak_extra_bytes"]
    # The planner's FP32 working set (cluster/memory.py _logprob_bytes, minus the logits and, for
    # chunks, plus their FP32 gradient): 5 [S, V] whole; 4 [chunk, V] + the [S, V] gradient chunked.
    out["planned_whole_extra_bytes"] = 5 * 4 * args.seq * args.vocab
    out["planned_chunked_extra_bytes"] = 4 * 4 * args.chunk * args.vocab + 4 * args.seq * args.vocab
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    print(json.dumps({"packing": bench_packing(args), "logprobs": bench_logprobs(args)}, indent=2))


if __name__ == "__main__":
    main()
