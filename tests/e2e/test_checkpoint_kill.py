"""A training process killed (SIGKILL) in the middle of a checkpoint save, then resumed.

The real loop runs in a child process with a hook in the checkpointer that kills the process at
one point of the second save: after every rank wrote the step folder but before it is renamed,
or after the rename but before the `latest` marker moves. The previous checkpoint must stay the
latest, and the resumed run must repeat the killed step exactly as the killed run had logged it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.telemetry.logger import read_jsonl

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import EXAMPLES, TINY  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHILD = Path(__file__).with_name("_kill_mid_save.py")


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of the child's session (its reward worker, a resource tracker)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


DETERMINISTIC = ("reward/mean", "pg_loss", "grad_norm", "entropy", "calib/low", "calib/high", "sync/version")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kill")  # both runs share one warm-started tiny model (root/.tiny_models)


def _resume(log_dir: Path) -> list[dict]:
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.config import load_config
    from megatron_rl.train import run

    cfg = load_config(EXAMPLES / "fp8_calibrated.yaml", [*TINY, f"log.dir={log_dir}", "train.num_steps=2",
                                                         "checkpoint.save_every=1", "checkpoint.resume=true"])
    try:
        run(cfg)
    finally:
        destroy_parallel()
    return read_jsonl(log_dir / "metrics.jsonl")


@pytest.mark.parametrize("where", ["before_folder_rename", "before_latest_rename"])
def test_kill_mid_save_keeps_the_previous_checkpoint_and_resume_repeats_the_step(root, where, caplog):
    log_dir = root / where
    overrides = [*TINY, f"log.dir={log_dir}", "train.num_steps=2", "checkpoint.save_every=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = root / f"{where}.log"
    with open(log, "w") as out:  # a file, not a pipe: the reward worker may outlive its killed parent
        proc = subprocess.Popen([sys.executable, str(CHILD), where, "2", str(EXAMPLES / "fp8_calibrated.yaml"),
                                 json.dumps(overrides)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=200)
        finally:
            _kill_group(proc.pid)
    assert returncode == -signal.SIGKILL, log.read_text()[-3000:]
    killed = read_jsonl(log_dir / "metrics.jsonl")
    assert [r["step"] for r in killed] == [0, 1]  # step 1 was logged, its save was killed
    ckpts = log_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "1"
    assert (ckpts / "step_000001" / "rl_state.pt").is_file()
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.checkpoint"):
        resumed = _resume(log_dir)
    assert f"resumed from {ckpts / 'step_000001'} (step 1)" in caplog.text  # not the killed save
    assert [r["step"] for r in resumed] == [0, 1]  # step 1 logged again by the resumed run
    for key in DETERMINISTIC:
        assert resumed[1].get(key) == killed[1].get(key), key
    assert (ckpts / "latest").read_text() == "2" and not list(ckpts.glob("*.tmp"))
