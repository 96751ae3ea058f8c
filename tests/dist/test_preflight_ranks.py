"""A bad eval file under torchrun with two ranks: each rank refuses it with one error line before it
builds anything (no tiny model, no process group to hang in), and the job ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_rank_refuses_a_missing_eval_file_before_building(tmp_path):
    ds = "eval.datasets=" + json.dumps([{"name": "aime", "path": f"{tmp_path}/aime24.jsonl"}])
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "megatron_rl.train", str(ROOT / "examples/tiny/bf16.yaml"), ds,
                           f"log.dir={tmp_path}/runs/a"],
                          env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    line = f"megatron_rl.train: error: config key 'eval.datasets[0].path': no such file {tmp_path}/aime24.jsonl"
    assert proc.returncode != 0 and out.count(line) == 2, out[-3000:]
    # torchrun's own traceback (ChildFailedError) names no frame of ours: the ranks raised none.
    assert not [row for row in out.splitlines() if row.strip().startswith("File ") and "megatron_rl" in row]
    assert not (tmp_path / "runs").exists()  # neither the run folder nor the tiny model's cache beside it
