"""SIGUSR1 to a real training process, under each entry point (`megatron-rl train`, whose console
script runs megatron_rl.cli:main, and `python -m megatron_rl.train`): the run stops after the step
it is in, with a checkpoint of it, and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.telemetry.logger import read_jsonl

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import EXAMPLES, TINY  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 8  # enough that the signal, sent once step 0 is logged, arrives with steps left


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("usr1")  # one warm-started tiny model for both entry points


@pytest.mark.parametrize("entry", [["megatron_rl.cli", "train"], ["megatron_rl.train"]], ids=["cli", "module"])
def test_sigusr1_stops_after_the_current_step_with_a_checkpoint(root, entry):
    log_dir = root / entry[0]
    args = [*TINY, f"log.dir={log_dir}", f"train.num_steps={STEPS}", "sync.check=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MEGATRON_RL_STOP_REQUEST", None)
    with open(root / f"{entry[0]}.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", *entry, str(EXAMPLES / "bf16.yaml"), *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            metrics = log_dir / "metrics.jsonl"
            while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
                time.sleep(0.05)
            proc.send_signal(signal.SIGUSR1)
            returncode = proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert returncode == 0, (root / f"{entry[0]}.log").read_text()[-3000:]
    steps = [r["step"] for r in read_jsonl(log_dir / "metrics.jsonl")]
    last = steps[-1]
    assert steps == list(range(last + 1)) and last + 1 < STEPS  # stopped early, after a whole step
    ckpts = log_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == str(last + 1)
    assert (ckpts / f"step_{last + 1:06d}" / "rl_state.pt").is_file()
