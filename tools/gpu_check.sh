#!/usr/bin/env bash
# The GPU check of the real stack: run it from the repository root on a machine with one CUDA GPU
# (H100/H200) and the packages already installed (torch, megatron-core; Transformer Engine and SGLang
# when present). It installs and downloads nothing; a check whose package is missing prints SKIP.
#
#   bash tools/gpu_check.sh [OUT_DIR]
#
# One line per check, `PASS name: detail`, `FAIL name: error` or `SKIP name: reason`, then the
# JSON of every check in OUT_DIR/gpu_check.json; exit 1 when any check fails. Budget: the Python
# checks run under one 4-minute timeout, the tiny loop, the CUDA pytest and SGLang's pytest under 2
# minutes each.
#
# Checks (a ~0.2B model unless stated; TE = the Transformer Engine layer spec):
#   wgrad_fusion          gradient_accumulation_fusion follows apex's import, and the TE actor builds
#                         either way (Megatron's output layer raises without apex when it is on)
#   te_<recipe>           TE spec + Megatron FP8 (delayed, tensorwise, blockwise): 3 train steps, finite
#                         loss, FP8 log-probs within 1 nat of the BF16 shadow's (random init)
#   packed_thd            TE spec, packed THD rows give the padded rows' log-probs (1e-2)
#   recompute_full        full recompute gives no-recompute's loss and grad norm (1e-3 relative)
#   bf16_distopt          BF16 params + distributed optimizer (DP=1): FP32 main params, loss decreases
#   chunked_logprobs      logprob_chunk_size=128 equals the whole-vocab pass (1e-4)
#   plan_peak             cluster/memory.py's trainer estimate vs max_memory_allocated (~1B, 4K tokens):
#                         within [0.8, 1.5] x
#   tiny_loop             the whole loop of examples/tiny/fp8_calibrated.yaml on the GPU, 4 steps (local spec)
#   pytest_gpu            tests/gpu/test_actor_gpu.py, test_plan_memory.py and test_packing_cuda.py (CUDA only, no TE or SGLang)
#   sglang                tests/gpu/test_sglang_smoke.py + test_sglang_ipc_payload.py on real SGLang: BF16
#                         launch, log-probs vs HF, each transport; and a block-FP8 checkpoint with an FP8
#                         KV cache and CUDA graphs in the memory saver: the protocol's release tags, the
#                         split resume and an FP8 update (unit KV scales) inside the session
set -uo pipefail

OUT_DIR="${1:-${OUT:-gpu_check_out}}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export NVTE_FLASH_ATTN="${NVTE_FLASH_ATTN:-1}" NVTE_FUSED_ATTN="${NVTE_FUSED_ATTN:-1}"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "SKIP all: no CUDA torch here"
    exit 0
fi

# megatron-core from a carried wheel (a local file: --no-deps --no-index, nothing is downloaded)
# when the machine lacks it: MCORE_WHEEL=path/to/megatron_core-0.16.1-*.whl bash tools/gpu_check.sh
if ! "$PYTHON" -c "import megatron.core" 2>/dev/null && [[ -n "${MCORE_WHEEL:-}" ]]; then
    "$PYTHON" -m pip install --no-deps --no-index "$MCORE_WHEEL" > "$OUT_DIR/pip.log" 2>&1 \
        || echo "FAIL mcore_wheel: pip install $MCORE_WHEEL failed, see $OUT_DIR/pip.log"
fi

timeout 240 "$PYTHON" - "$OUT_DIR/gpu_check.json" <<'PY'
import importlib.util
import json
import math
import sys
import time
import traceback

import torch

RESULTS = {}


class Skip(Exception):
    pass


def check(name):
    def run(fn):
        start = time.perf_counter()
        try:
            detail = fn()
            status = "PASS" if detail.pop("ok", True) else "FAIL"
        except Skip as why:
            status, detail = "SKIP", {"reason": str(why)}
        except Exception as err:  # report and go on: every check gets its line
            status, detail = "FAIL", {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
        detail["seconds"] = round(time.perf_counter() - start, 1)
        RESULTS[name] = {"status": status, **detail}
        shown = {k: v for k, v in detail.items() if k != "trace"}
        print(f"{status} {name}: {json.dumps(shown)}", flush=True)
        torch.cuda.empty_cache()
    return run


def need(module):
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{module} is not installed")


def te_usable():
    from megatron_rl.fp8.te_recipe import te_available
    if not te_available():
        raise Skip("transformer_engine does not import on this machine")


PAR = None


def parallel():
    global PAR
    if PAR is None:
        from megatron_rl.actor.parallel import init_parallel
        from megatron_rl.actor.quiet import megatron_quiet
        with megatron_quiet():
            PAR = init_parallel(1, 1, seed=0)
    return PAR


def cfg_of(*overrides):
    """A run config; the checks that do not name a layer spec take TE when it imports, else local."""
    from megatron_rl.config import load_config
    from megatron_rl.fp8.te_recipe import te_available
    keys = list(overrides)
    if not any(k.startswith("parallel.transformer_impl") for k in keys) and not te_available():
        keys.append("parallel.transformer_impl=local")
    return load_config(None, keys)


def settings_of(cfg):
    from megatron_rl.actor.settings import resolve_settings
    from megatron_rl.fp8.te_recipe import wgrad_fusion_available
    return resolve_settings(cfg, cuda=True, wgrad_fusion=wgrad_fusion_available())


def spec(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=2816, vocab=32000):
    from megatron_rl.models.hf_config import ModelSpec
    return ModelSpec(arch="llama", vocab_size=vocab, hidden_size=hidden, ffn_hidden_size=ffn, num_layers=layers,
                     num_attention_heads=heads, num_query_groups=kv_heads, head_dim=hidden // heads,
                     norm_eps=1e-5, max_position_embeddings=8192, rope_theta=500000.0)


def actor_of(cfg, model=None):
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.loop.build import build_fp8_recipe
    return MegatronActor.build(model or spec(), parallel=parallel(), fp8_recipe=build_fp8_recipe(cfg), lr=1e-4,
                               settings=settings_of(cfg))


def batch(rows, seq, vocab=32000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=gen)
    mask = torch.zeros(rows, seq)
    for r, n in enumerate(lengths.tolist()):
        mask[r, seq // 8:n] = 1.0
    return {"tokens": torch.randint(0, vocab, (rows, seq), generator=gen), "loss_mask": mask,
            "advantages": torch.randn(rows, seq, generator=gen)}


def loss_fn(denominator):
    def fn(logprobs, entropy, mb):
        total = -(logprobs * mb["advantages"] * mb["loss_mask"]).sum()
        return total / denominator, {"pg": torch.stack([total.detach().double(), mb["loss_mask"].sum().double()])}
    return fn


def train(actor, b, steps, mbs=2, **kw):
    fn = loss_fn(float(b["loss_mask"].sum()))
    return [actor.train_step(b, fn, micro_batch_size=mbs, **kw) for _ in range(steps)]


def masked_max_diff(a, b, mask):
    on = mask > 0
    return float((a[on] - b[on]).abs().max())


props = torch.cuda.get_device_properties(0)
RESULTS["device"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability()),
                     "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__}
print(f"device: {json.dumps(RESULTS['device'])}", flush=True)


@check("wgrad_fusion")
def _():
    te_usable()
    from megatron_rl.fp8.te_recipe import wgrad_fusion_available
    cfg = cfg_of("parallel.transformer_impl=transformer_engine")
    s = settings_of(cfg)
    actor = actor_of(cfg, spec(layers=2))
    fused = actor.config.gradient_accumulation_fusion
    out = train(actor, batch(2, 256), 1)
    return {"apex": wgrad_fusion_available(), "fusion": fused, "loss": out[0]["loss"],
            "ok": fused == s.gradient_accumulation_fusion == wgrad_fusion_available() and math.isfinite(out[0]["loss"])}


def te_recipe_check(recipe):
    te_usable()
    cfg = cfg_of("parallel.transformer_impl=transformer_engine", f"precision.train_recipe={recipe}")
    actor = actor_of(cfg)
    b = batch(4, 512)
    out = train(actor, b, 3)
    fp8 = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False)["logprobs"]
    bf16 = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False, fp8=False)["logprobs"]
    diff = masked_max_diff(fp8, bf16, b["loss_mask"])
    losses = [o["loss"] for o in out]
    return {"loss": [round(x, 4) for x in losses], "max_abs_fp8_vs_bf16": round(diff, 4),
            "ok": all(math.isfinite(x) for x in losses) and diff < 1.0}  # random init: FP8 noise stays well under 1 nat


for _recipe in ("delayed", "tensorwise", "blockwise"):
    check(f"te_{_recipe}")(lambda r=_recipe: te_recipe_check(r))


@check("packed_thd")
def _():
    te_usable()
    from megatron_rl.actor.packing import pack_batch, unpack
    cfg = cfg_of("parallel.transformer_impl=transformer_engine")
    actor = actor_of(cfg)
    b = batch(6, 384)
    padded = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False)["logprobs"]
    packed, index = pack_batch(b, budget=1024, multiple=16)
    thd = unpack(actor.compute_logprobs(packed, micro_batch_size=1, with_entropy=False)["logprobs"], index)
    diff = masked_max_diff(thd, padded, b["loss_mask"])
    return {"rows": int(packed["tokens"].shape[0]), "max_abs_diff": round(diff, 5), "ok": diff < 1e-2}


@check("recompute_full")
def _():
    results = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        actor = actor_of(cfg_of(f"parallel.recompute_granularity={mode}", "parallel.recompute_num_layers=1"))
        out = train(actor, batch(2, 512), 1)[0]
        results[mode] = (out["loss"], out["grad_norm"])
        del actor
    (l0, g0), (l1, g1) = results["none"], results["full"]
    return {"loss": [l0, l1], "grad_norm": [g0, g1],
            "ok": abs(l0 - l1) <= 1e-3 * abs(l0) + 1e-6 and abs(g0 - g1) <= 1e-3 * g0 + 1e-6}


@check("bf16_distopt")
def _():
    cfg = cfg_of("precision.params_dtype=bf16", "parallel.use_distributed_optimizer=true")
    actor = actor_of(cfg)
    out = train(actor, batch(4, 512), 3)
    params = actor._params.values()
    main = [p.main_param for p in params if getattr(p, "main_param", None) is not None]
    return {"params": sorted({str(p.dtype) for p in params}), "main": sorted({str(p.dtype) for p in main}),
            "loss": [round(o["loss"], 4) for o in out],
            "ok": out[-1]["loss"] < out[0]["loss"] and {str(p.dtype) for p in params} == {"torch.bfloat16"}}


@check("chunked_logprobs")
def _():
    actor = actor_of(cfg_of())
    b = batch(2, 512)
    whole = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False)["logprobs"]
    chunked = actor.compute_logprobs(b, micro_batch_size=2, with_entropy=False, logprob_chunk_size=128)["logprobs"]
    diff = masked_max_diff(chunked, whole, b["loss_mask"])
    return {"max_abs_diff": diff, "ok": diff < 1e-4}


@check("plan_peak")
def _():
    from megatron_rl.cluster.memory import trainer_memory
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = spec(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632)  # ~0.9B
    cfg = cfg_of("precision.params_dtype=bf16", "train.micro_batch_size=1", "data.max_prompt_len=512",
                 "rollout.max_new_tokens=3584", "parallel.recompute_granularity=none")
    actor = actor_of(cfg, model)
    train(actor, batch(1, 4096), 1, mbs=1)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    parts = trainer_memory(cfg, model, dp=1, cuda=True)
    planned = sum(v for k, v in parts.items() if k != "cuda_context")  # the allocator does not see the context
    ratio = planned / measured
    return {"planned_gib": round(planned / 2**30, 2), "measured_gib": round(measured / 2**30, 2),
            "ratio": round(ratio, 3), "ok": 0.8 <= ratio <= 1.5}


@check("sglang_import")
def _():
    need("sglang")
    import sglang  # noqa: F401  (the GPU tests below need the full install, not the source only)
    from importlib.metadata import version
    return {"version": version("sglang")}


ok = all(r["status"] != "FAIL" for k, r in RESULTS.items() if k != "device")
open(sys.argv[1], "w").write(json.dumps(RESULTS, indent=1))
sys.exit(0 if ok else 1)
PY
rc=$?
[[ $rc -eq 124 ]] && echo "FAIL python_checks: timed out after 240 s"

# The whole loop on this GPU (embedded engine, blockwise FP8 emulated on the local spec): warm start,
# 4 GRPO steps with Calibrated Clipping, held-out eval, checkpoints. Only its log and metrics come back.
timeout 120 "$PYTHON" -m megatron_rl.cli train examples/tiny/fp8_calibrated.yaml parallel.transformer_impl=local \
    train.num_steps=4 train.sft_steps=10 eval.every=0 checkpoint.save_every=2 log.dir=/tmp/gpu_check_tiny_loop \
    > "$OUT_DIR/tiny_loop.log" 2>&1
lrc=$?
cp /tmp/gpu_check_tiny_loop/metrics.jsonl "$OUT_DIR/tiny_loop_metrics.jsonl" 2>/dev/null
steps=$(grep -c '"step"' "$OUT_DIR/tiny_loop_metrics.jsonl" 2>/dev/null || echo 0)
if [[ $lrc -eq 0 && $steps -ge 4 ]]; then echo "PASS tiny_loop: $steps metric rows on cuda"
else echo "FAIL tiny_loop: rc=$lrc, $steps metric rows (see $OUT_DIR/tiny_loop.log)"; rc=1; fi

# The CUDA-only tests of the suite that need neither TE nor SGLang.
timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu/test_actor_gpu.py tests/gpu/test_plan_memory.py tests/gpu/test_packing_cuda.py \
    > "$OUT_DIR/pytest_gpu.log" 2>&1
grc=$?
line="$(tail -n 1 "$OUT_DIR/pytest_gpu.log")"
if [[ $grc -eq 0 ]]; then echo "PASS pytest_gpu: $line"; else echo "FAIL pytest_gpu: rc=$grc $line (see $OUT_DIR/pytest_gpu.log)"; rc=1; fi

if "$PYTHON" -c "import sglang, pytest" 2>/dev/null; then
    timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu/test_sglang_smoke.py tests/gpu/test_sglang_ipc_payload.py \
        > "$OUT_DIR/pytest_sglang.log" 2>&1
    prc=$?
    line="$(tail -n 1 "$OUT_DIR/pytest_sglang.log")"
    if [[ $prc -eq 0 ]]; then echo "PASS sglang: $line"; else echo "FAIL sglang: rc=$prc $line (see $OUT_DIR/pytest_sglang.log)"; rc=1; fi
else
    echo "SKIP sglang: sglang (full install) or pytest is missing"
fi
exit $rc
