"""Rollout-vs-trainer mismatch of the tiny FP8 loop with the embedded engine's emulated FP8 KV cache:
no FP8 KV cache, unit k/v scales, calibrated scales (rollout.sglang.kv_scales), as JSON per step.

Step 0 of the two FP8 arms is the same run (unit scales until the first old-log-prob pass records
the amax); later steps sample from different weights per arm, so compare means over steps.

examples:
  python tools/bench/fp8_kv_mismatch.py --steps 6 --out fp8_kv_mismatch.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {"bf16_kv": [], "fp8_kv_unit": ["rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.kv_scales=unit"],
        "fp8_kv_calibrated": ["rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.kv_scales=calibrated"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    from test_rl_loop import run_tiny

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, overrides in ARMS.items():
            records = run_tiny(Path(tmp) / arm, "fp8_calibrated.yaml", f"train.num_steps={args.steps}", *overrides)
            per_step = [{k: v for k, v in r.items() if k.startswith("mismatch/")} for r in records]
            means = {k: sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}
            out[arm] = {"per_step": per_step, "mean": means}
    for arm in ("fp8_kv_unit", "fp8_kv_calibrated"):
        out[arm]["k3_kl_vs_bf16_kv"] = out[arm]["mean"]["mismatch/k3_kl"] / out["bf16_kv"]["mean"]["mismatch/k3_kl"]
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
