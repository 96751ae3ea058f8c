"""Benchmark: checkpoint conversion throughput and peak memory over model size.

For each size, a random Llama-style HF checkpoint (bf16 safetensors, no transformers model built)
is converted HF -> Megatron torch_dist (--tp 2), Megatron -> HF, and HF -> FP8, each in a fresh
process. Prints one JSON object; per conversion:
- seconds, gb_per_s = bytes written / seconds;
- peak_rss_gb: the process's high-water RSS (VmHWM), imports included;
- base_rss_gb: RSS after imports, before converting;
- extra_over_model = (peak - base) / model bytes: the conversion's own memory as a fraction of
  the checkpoint size (the issue's bound: "well under 2x").

Usage: OMP_NUM_THREADS=2 python tools/bench/convert.py [--layers 2 8 28] [--work-dir /tmp]
(28 layers of hidden 1024 / FFN 4096 / vocab 32768 is ~0.5B parameters, ~1 GB in bf16.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DIMS = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=8,
            vocab_size=32768)


def llama_config(num_layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "num_hidden_layers": num_layers, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "dtype": "bfloat16", **DIMS}


def write_random_hf(out_dir: Path, num_layers: int) -> tuple[int, int]:
    """A random bf16 checkpoint written tensor by tensor; returns (parameters, bytes)."""
    from megatron_rl.convert.mcore_layout import expected_hf_shapes
    from megatron_rl.convert.safetensors_io import ShardedSafetensorsWriter, TensorEntry
    from megatron_rl.models.hf_config import ModelSpec

    config = llama_config(num_layers)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    shapes = expected_hf_shapes(ModelSpec.from_hf_config(config))
    entries = [TensorEntry(name, shape, torch.bfloat16) for name, shape in shapes.items()]
    gen = torch.Generator().manual_seed(0)
    with ShardedSafetensorsWriter(out_dir, entries, max_shard_bytes=2 * 10**9) as writer:
        for entry in entries:
            writer.write(entry.name, (0.02 * torch.randn(entry.shape, generator=gen)).to(torch.bfloat16))
        total = writer.close()
    return sum(torch.Size(e.shape).numel() for e in entries), total


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(f"{field} not in /proc/self/status")


def child(kind: str, src: str, dst: str) -> None:
    """One conversion in this (fresh) process; prints its JSON result line."""
    from megatron_rl.convert.hf_to_fp8 import convert_hf_to_fp8
    from megatron_rl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_rl.convert.megatron_to_hf import convert_megatron_to_hf

    base = rss_kib("VmRSS")
    if kind == "hf_to_megatron":
        summary = convert_hf_to_megatron(src, dst, tp=2, progress=False)
    elif kind == "megatron_to_hf":
        summary = convert_megatron_to_hf(src, dst, progress=False)
    else:
        summary = convert_hf_to_fp8(src, dst, progress=False)
    print(json.dumps({"seconds": round(summary.seconds, 3), "gb_per_s": round(summary.gb_per_s, 3),
                      "bytes_written": summary.bytes_written,
                      "base_rss_gb": round(base / 2**20, 3), "peak_rss_gb": round(rss_kib("VmHWM") / 2**20, 3)}))


def run_child(kind: str, src: Path, dst: Path, model_bytes: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", kind, str(src), str(dst)],
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    extra = (result["peak_rss_gb"] - result["base_rss_gb"]) * 2**30
    result["extra_over_model"] = round(extra / model_bytes, 3)
    return result


def bench_size(num_layers: int, work: Path) -> dict:
    start = time.perf_counter()
    params, model_bytes = write_random_hf(work / "hf", num_layers)
    row = {"num_layers": num_layers, "parameters": params, "model_gb": round(model_bytes / 1e9, 3),
           "random_model_seconds": round(time.perf_counter() - start, 1)}
    row["hf_to_megatron"] = run_child("hf_to_megatron", work / "hf", work / "mcore", model_bytes)
    row["megatron_to_hf"] = run_child("megatron_to_hf", work / "mcore", work / "hf_back", model_bytes)
    row["hf_to_fp8"] = run_child("hf_to_fp8", work / "hf", work / "fp8", model_bytes)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 28])
    parser.add_argument("--work-dir", default=None, help="scratch folder (default: system temp)")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    rows = []
    for num_layers in args.layers:
        with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
            rows.append(bench_size(num_layers, Path(work)))
    print(json.dumps({"dims": DIMS, "threads": torch.get_num_threads(), "sizes": rows}, indent=2))


if __name__ == "__main__":
    main()
