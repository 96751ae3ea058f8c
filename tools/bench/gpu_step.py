"""GPU benchmark: FP8 vs BF16 train throughput, weight-sync time, and an RL step split into phases.

Prints one JSON object:
- "train": forward+backward tokens/s of a slice of the model's linear layers (QKV, O, gate/up,
  down at the model's sizes), BF16 and, with Transformer Engine, FP8 (blockwise, else delayed);
  "fp8_speedup" = fp8 / bf16 tokens/s.
- "sync": for the slice's weights: blockwise FP8 quantization (the sync path's quantizer), 512 MiB
  bucketing, and a device-to-device copy of every bucket (the colocated transport's lower bound);
  seconds and GB/s, plus "full_model_seconds" scaled by num_layers / layers.
- "step" (with --config or --metrics): mean time/rollout, time/train, sync/seconds, time/step of a
  real run's metrics.jsonl after --warmup steps.

Without CUDA it prints {"skipped": ...} and exits 0 (`make bench` runs it on CPU too).

Usage: python tools/bench/gpu_step.py --model qwen3-8b --layers 4 --tokens 8192
       python tools/bench/gpu_step.py --config examples/qwen3_8b_grpo/fp8_calibrated.yaml --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# (hidden, ffn, heads, kv_heads, head_dim, num_layers) of the paper's models
MODELS = {"qwen3-8b": (4096, 12288, 32, 8, 128, 36), "qwen3-14b": (5120, 17408, 40, 8, 128, 40),
          "qwen2.5-32b": (5120, 27648, 40, 8, 128, 64)}


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    """HF name suffix -> (out, in) of one decoder layer's linears."""
    hidden, ffn, heads, kv, head_dim, _ = MODELS[model]
    return {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv * head_dim, hidden),
            "self_attn.v_proj": (kv * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
            "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_train(model: str, layers: int, tokens: int, repeats: int) -> dict:
    shapes = list(linear_shapes(model).values()) * layers
    x = torch.randn(tokens, MODELS[model][0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = {"tokens": tokens, "layers": layers}
    torch_layers = [torch.nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16) for o, i in shapes]
    out["bf16_tokens_per_s"] = tokens / timed(lambda: _fwd_bwd(torch_layers, x), repeats)
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe
    except ImportError:
        out["fp8"] = "transformer_engine not installed"
        return out
    te_layers = [te.Linear(i, o, bias=False, params_dtype=torch.bfloat16) for o, i in shapes]
    fp8_recipe = recipe.Float8BlockScaling() if hasattr(recipe, "Float8BlockScaling") else recipe.DelayedScaling()

    def fp8_step():
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            _fwd_bwd(te_layers, x)

    out["fp8_recipe"] = type(fp8_recipe).__name__
    out["fp8_tokens_per_s"] = tokens / timed(fp8_step, repeats)
    out["fp8_speedup"] = out["fp8_tokens_per_s"] / out["bf16_tokens_per_s"]
    return out


def _fwd_bwd(layers, x) -> None:
    """Each linear applied to the layer input (sizes, not a real residual stream), summed for backward."""
    total = 0.0
    for layer in layers:
        inp = x if layer.in_features == x.shape[1] else x.new_ones(x.shape[0], layer.in_features)
        total = total + layer(inp).float().square().mean()
    total.backward()


def bench_sync(model: str, layers: int, repeats: int, bucket_mb: float) -> dict:
    from megatron_rl.sync.buckets import iter_buckets, tensor_bytes
    from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout

    weights = [(f"model.layers.{i}.{suffix}.weight", torch.randn(shape, device="cuda", dtype=torch.bfloat16))
               for i in range(layers) for suffix, shape in linear_shapes(model).items()]
    spec = RolloutQuantSpec("fp8_blockwise")
    quantized: list = []
    quant_s = timed(lambda: quantized.__setitem__(slice(None), list(quantize_for_rollout(weights, spec))), repeats)
    buckets = list(iter_buckets(quantized, int(bucket_mb * 2**20)))

    def copy_all():
        for bucket in buckets:
            for _, t in bucket:
                torch.empty_like(t).copy_(t)

    copy_s = timed(copy_all, repeats)
    nbytes = sum(tensor_bytes(t) for _, t in quantized)
    scale = MODELS[model][5] / layers
    return {"bytes": nbytes, "num_buckets": len(buckets), "quantize_seconds": quant_s, "copy_seconds": copy_s,
            "gb_per_s": nbytes / (quant_s + copy_s) / 1e9, "full_model_seconds": (quant_s + copy_s) * scale}


def bench_step(metrics_path: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()][warmup:]
    keys = ("time/rollout", "time/train", "sync/seconds", "time/step")
    return {k: statistics.mean(r[k] for r in rows if k in r) for k in keys if any(k in r for r in rows)} | {
        "steps": len(rows)}


def run_config(config: str, steps: int) -> Path:
    log_dir = Path(tempfile.mkdtemp(prefix="gpu_step_"))
    subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", config, f"train.num_steps={steps}",
                    f"log.dir={log_dir}", "checkpoint.save_final=false", "checkpoint.resume=false"], check=True)
    return log_dir / "metrics.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers in the measured slice")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--config", help="run this config for --steps steps and report the phase split")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--metrics", type=Path, help="report the phase split of an existing metrics.jsonl")
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu_step", "skipped": "needs CUDA"}))
        return
    result = {"bench": "gpu_step", "device": torch.cuda.get_device_name(), "model": args.model,
              "train": bench_train(args.model, args.layers, args.tokens, args.repeats),
              "sync": bench_sync(args.model, args.layers, args.repeats, args.bucket_mb)}
    metrics = run_config(args.config, args.steps) if args.config else args.metrics
    if metrics:
        result["step"] = bench_step(metrics, args.warmup)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
