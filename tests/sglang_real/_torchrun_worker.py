"""Run by torchrun (one worker): launch one real SGLang server through the project's own path
(SGLangEngine -> build_servers -> launch_env), generate once, write the result, stop the server.

    torchrun --nproc-per-node 1 --master-addr 127.0.0.1 --master-port P \
        tests/sglang_real/_torchrun_worker.py MODEL_DIR OUT_JSON HTTP_PORT [--collide]

--collide: HTTP_PORT is MASTER_PORT - DIST_PORT_OFFSET, so the first dist port the launcher would
try (HTTP port + offset) is torchrun's MASTER_PORT; the launcher must move it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_sglang  # noqa: E402


def main() -> None:
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    model, out, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    extra = list(real_sglang.CPU_ARGS)
    cfg = real_sglang.sglang_config(base_port=port, mode="disaggregated", weight_transport="nccl",
                                    extra_args=extra, startup_timeout_s=float(os.environ.get("START_S", "240")))
    env = {k: os.environ.get(k) for k in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT")}
    engine = SGLangEngine(cfg, model, seed=0, log_dir=out.parent)
    try:
        (sample,) = engine.generate([[1, 5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
        argv = engine.servers[0].process.argv
        dist_port = int(argv[argv.index("--nccl-port") + 1])
        out.write_text(json.dumps({"tokens": sample.response_ids, "worker_env": env, "dist_port": dist_port}))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
