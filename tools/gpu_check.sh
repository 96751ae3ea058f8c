#!/usr/bin/env bash
# The one GPU check of the actor: run it on a machine with one CUDA GPU (H100/H200) from the
# repository root. It needs Python 3.12 (or 3.11) with a CUDA torch; Transformer Engine and SGLang
# are not needed (the actor runs on the local layer spec, an explicit opt-out of TE) and nothing is
# downloaded: a megatron-core wheel is carried in when the environment lacks it.
#
#   MCORE_WHEEL=path/to/megatron_core-0.16.1-*.whl bash tools/gpu_check.sh [OUT_DIR]
#
# Steps (about 3-5 minutes on an H200; each one under its own timeout, the whole run < 8 min):
#   1. install the carried megatron-core wheel (--no-deps, --no-index) if megatron.core is missing
#   2. pytest tests/gpu (when pytest is importable; the GPU tests skip cleanly elsewhere)
#   3. a BF16 train step with the distributed optimizer (+ grad-reduce / param-gather overlap)
#   4. a real FP8 GEMM through torch._scaled_mm against the emulated quantizers
#   5. the actor's peak GPU memory for a ~1B random Llama-style model at 4K tokens, recompute
#      none vs full
#   and what the default (auto) layer spec does here: TE, or a refusal when TE is missing
# Prints one JSON object (also written to OUT_DIR/gpu_check.json); a failed step is reported in
# it with its error and makes the script exit 1.
set -uo pipefail

OUT_DIR="${1:-${OUT:-gpu_check_out}}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

# 1. megatron-core
if ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    if [[ -z "${MCORE_WHEEL:-}" ]]; then
        echo '{"error": "megatron.core is not importable and MCORE_WHEEL is not set"}'
        exit 1
    fi
    "$PYTHON" -m pip install --no-deps --no-index "$MCORE_WHEEL" > "$OUT_DIR/pip.log" 2>&1 \
        || { echo "{\"error\": \"pip install $MCORE_WHEEL failed, see $OUT_DIR/pip.log\"}"; exit 1; }
fi

# 2. tests/gpu
PYTEST_SUMMARY="pytest not installed"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu > "$OUT_DIR/pytest_gpu.log" 2>&1
    PYTEST_RC=$?
    PYTEST_SUMMARY="rc=$PYTEST_RC: $(tail -n 1 "$OUT_DIR/pytest_gpu.log")"
fi
export PYTEST_SUMMARY

# 3-5. one Python process (imports dominate), each check recorded separately
timeout 300 "$PYTHON" - "$OUT_DIR/gpu_check.json" <<'PY'
import json
import os
import sys
import time
import traceback

import torch

results = {"pytest_gpu": os.environ.get("PYTEST_SUMMARY", ""), "checks": {}}


def check(name):
    def run(fn):
        start = time.perf_counter()
        try:
            results["checks"][name] = {"ok": True, **fn()}
        except Exception:  # report and go on: one JSON with every check's outcome
            results["checks"][name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
        results["checks"][name]["seconds"] = round(time.perf_counter() - start, 1)
        return fn
    return run


def describe():
    from importlib.metadata import version

    props = torch.cuda.get_device_properties(0)
    results["device"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability()),
                         "memory_gib": round(props.total_memory / 2**30, 1),
                         "torch": torch.__version__, "cuda": torch.version.cuda,
                         "python": sys.version.split()[0], "megatron_core": version("megatron-core")}


def parallel():
    from megatron_rl.actor.parallel import init_parallel
    from megatron_rl.actor.quiet import megatron_quiet

    with megatron_quiet():
        return init_parallel(1, 1, seed=0)


def settings(**overrides):
    from megatron_rl.actor.settings import resolve_settings
    from megatron_rl.config import load_config

    keys = ["parallel.transformer_impl=local"] + [f"{k}={v}" for k, v in overrides.items()]
    return resolve_settings(load_config(None, keys), cuda=True)


def batch(rows, seq, vocab):
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(rows, seq)
    mask[:, seq // 8:] = 1.0
    return {"tokens": torch.randint(0, vocab, (rows, seq), generator=gen), "loss_mask": mask,
            "advantages": torch.randn(rows, seq, generator=gen)}


def loss_fn(denominator):
    def fn(logprobs, entropy, mb):
        total = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
        return total / denominator, {"pg": torch.stack([total.detach().double(),
                                                        mb["loss_mask"].sum().double()])}
    return fn


def llama_spec(hidden, layers, heads, kv_heads, ffn, vocab):
    from megatron_rl.models.hf_config import ModelSpec

    return ModelSpec(arch="llama", vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn,
                     num_layers=layers, num_attention_heads=heads, num_query_groups=kv_heads,
                     head_dim=hidden // heads, norm_eps=1e-5, max_position_embeddings=8192,
                     rope_theta=500000.0)


if not torch.cuda.is_available():
    print(json.dumps({"skipped": "no CUDA device"}))
    sys.exit(0)
describe()
PAR = parallel()


@check("te_gate")
def _():
    """CUDA defaults to Transformer Engine: a missing TE is refused, not silently replaced."""
    from megatron_rl.loop.build import build_actor_settings
    from megatron_rl.config import load_config
    from megatron_rl.fp8.te_recipe import te_available

    try:
        chosen = build_actor_settings(load_config(None, [])).transformer_impl
    except ValueError as err:
        chosen = f"refused: {err}"
    return {"te_available": te_available(), "default_layers": chosen}


@check("bf16_distributed_optimizer_step")
def _():
    from megatron_rl.actor.actor import MegatronActor

    s = settings()  # CUDA defaults: bf16 params, distributed optimizer, both overlaps
    actor = MegatronActor.build(llama_spec(512, 4, 8, 4, 1536, 8192), parallel=PAR, lr=1e-4,
                                settings=s)
    b = batch(4, 512, 8192)
    fn = loss_fn(float(b["loss_mask"].sum()))
    losses = [actor.train_step(b, fn, micro_batch_size=2) for _ in range(3)]
    main = [p.main_param for p in actor._params.values() if getattr(p, "main_param", None) is not None]
    return {"summary": s.summary("bf16", PAR.dp_size),
            "param_dtypes": sorted({str(p.dtype) for p in actor._params.values()}),
            "main_param_dtypes": sorted({str(p.dtype) for p in main}),
            "loss": [round(o["loss"], 5) for o in losses],
            "grad_norm": [round(o["grad_norm"], 5) for o in losses],
            "loss_decreased": losses[-1]["loss"] < losses[0]["loss"]}


@check("fp8_scaled_mm")
def _():
    from megatron_rl.fp8 import dequantize, quantize
    from megatron_rl.fp8.formats import E4M3

    m = n = k = 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16)
    qa, sa = quantize(a, "tensorwise", E4M3)
    qb, sb = quantize(b, "tensorwise", E4M3)
    fp8 = lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa.float(), scale_b=sb.float(),  # noqa: E731
                                   out_dtype=torch.bfloat16)
    bf16 = lambda: a @ b.t()  # noqa: E731
    ref = dequantize(qa, sa, "tensorwise") @ dequantize(qb, sb, "tensorwise").t()
    rel = ((fp8().float() - ref).norm() / ref.norm()).item()

    def tflops(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return 2 * m * n * k * reps / (time.perf_counter() - start) / 1e12

    t8, t16 = tflops(fp8), tflops(bf16)
    return {"shape": [m, n, k], "rel_err_vs_emulated_dequant": rel, "fp8_tflops": round(t8, 1),
            "bf16_tflops": round(t16, 1), "fp8_speedup": round(t8 / t16, 2), "ok_numerics": rel < 1e-2}


def peak_memory(recompute):
    from megatron_rl.actor.actor import MegatronActor

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    spec = llama_spec(2048, 16, 16, 8, 5632, 32000)  # ~0.9B parameters
    actor = MegatronActor.build(spec, parallel=PAR, lr=1e-5,
                                settings=settings(**{"parallel.recompute_granularity": recompute}))
    num_params = sum(p.numel() for p in actor._params.values())
    after_build = torch.cuda.max_memory_allocated()
    b = batch(1, 4096, 32000)
    start = time.perf_counter()
    actor.train_step(b, loss_fn(float(b["loss_mask"].sum())), micro_batch_size=1)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    out = {"num_params": num_params, "after_build_gib": round(after_build / 2**30, 2),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "first_step_s": round(step_s, 2)}
    del actor
    return out


@check("peak_memory_1b_4k_tokens")
def _():
    none, full = peak_memory("none"), peak_memory("full")
    return {"recompute_none": none, "recompute_full": full,
            "full_vs_none_peak": round(full["peak_gib"] / none["peak_gib"], 3)}


results["ok"] = all(c["ok"] for c in results["checks"].values())
text = json.dumps(results, indent=1)
open(sys.argv[1], "w").write(text)
print(text)
sys.exit(0 if results["ok"] else 1)
PY
rc=$?
exit $rc
