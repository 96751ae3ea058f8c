"""The RL loop with a TP=2 actor (2 real processes under torchrun) and the embedded engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.telemetry.logger import read_jsonl

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import EXAMPLES, TINY, run_tiny  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(log_dir: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "megatron_rl.train", str(EXAMPLES / "bf16.yaml"), *TINY, f"log.dir={log_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_jsonl(log_dir / "metrics.jsonl")


@pytest.mark.timeout(240)  # 2 processes, 31 s measured: a broken rendezvous fails here, named
@pytest.mark.parametrize("parallel", ["parallel.tensor_model_parallel_size=2",
                                      "parallel.pipeline_model_parallel_size=2"])
def test_model_parallel_run_matches_one_process(tmp_path, parallel):
    steps = ("train.num_steps=2",)
    single = run_tiny(tmp_path / "one", "bf16.yaml", *steps)
    multi = _torchrun(tmp_path / "two" / "run", *steps, parallel)
    assert [r["step"] for r in multi] == [0, 1]
    # step 0: same engine weights and seeds, so the same samples; the update agrees to fp32 noise
    assert multi[0]["reward/mean"] == single[0]["reward/mean"]
    for key in ("pg_loss", "entropy", "grad_norm"):
        assert multi[0][key] == pytest.approx(single[0][key], rel=1e-4, abs=1e-6), key
    # the engine received the gathered TP shards / relayed PP stages (checksums checked)
    assert multi[-1]["sync/check_mismatches"] == 0 and multi[-1]["sync/version"] == 3
