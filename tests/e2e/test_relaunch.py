"""A relaunch into the log folder of a finished tiny run, through `megatron-rl train` (cli.main):
the same recipe resumes it (its lines and checkpoints kept), another recipe is refused and changes
no file, and only --overwrite starts afresh, leaving nothing of the old run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from megatron_rl.telemetry.logger import read_jsonl

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import EXAMPLES, TINY  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EVAL = ['eval.datasets=[{name: h, task: sort, n_samples: 1, max_examples: 8, metrics: ["avg@1"]}]',
        "eval.every=1", "checkpoint.keep_best=h/avg@1"]  # `best` names step 1 (scored at the top of step 1)
QUICK = ("sync.check=false", "checkpoint.save_every=1")


def _train(log_dir: Path, config: str, *args: str) -> int:
    """`megatron-rl train` in this process; its exit status."""
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.cli import main

    try:
        return main(["train", str(EXAMPLES / config), *TINY, *EVAL, *QUICK, f"log.dir={log_dir}", *args])
    finally:
        destroy_parallel()


def _files(log_dir: Path) -> dict[str, bytes]:
    """Every file under log_dir with its bytes (what a refused launch must leave as it was)."""
    return {str(p.relative_to(log_dir)): p.read_bytes() for p in sorted(log_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step FP8 + Calibrated Clipping run with checkpoints 1 and 2 and `best` (step 1)."""
    root = tmp_path_factory.mktemp("relaunch")
    assert _train(root / "finished", "fp8_calibrated.yaml", "train.num_steps=2") == 0
    ckpts = root / "finished" / "checkpoints"
    assert (ckpts / "latest").read_text() == "2" and (ckpts / "best").read_text() == "1"
    return root / "finished"


def _copy(finished: Path, name: str) -> Path:
    return Path(shutil.copytree(finished, finished.parent / name))  # beside it: its tiny-model cache


@pytest.mark.parametrize("args", [(), ("--resume",), ("checkpoint.resume=false",)])
def test_another_recipe_is_refused_and_changes_nothing(finished, tmp_path, capsys, args):
    log_dir = Path(shutil.copytree(finished, tmp_path / "run"))
    before = _files(log_dir)
    assert _train(log_dir, "bf16.yaml", "train.num_steps=3", *args) == 2
    err = capsys.readouterr().err
    if args == ("checkpoint.resume=false",):
        assert "holds a run" in err and "--overwrite" in err
    else:
        assert "precision.train_recipe: \"blockwise\" -> \"bf16\"" in err and "calib.enabled: true -> false" in err
    assert _files(log_dir) == before  # config.yaml, metrics, checkpoints, latest and best untouched


def test_a_relaunch_of_the_finished_run_changes_nothing(finished, tmp_path):
    log_dir = Path(shutil.copytree(finished, tmp_path / "run"))
    before = _files(log_dir)
    assert _train(log_dir, "fp8_calibrated.yaml", "train.num_steps=2") == 0
    assert _files(log_dir) == before


def test_the_same_recipe_resumes_the_run_and_keeps_its_lines(finished):
    log_dir = _copy(finished, "resumed")
    old_lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    assert _train(log_dir, "fp8_calibrated.yaml", "train.num_steps=3", "eval.every=0") == 0  # best stays
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    # Steps 0 and 1 are the old run's lines byte for byte (their timings too): only step 2 ran.
    assert lines[:2] == old_lines and [r["step"] for r in read_jsonl(log_dir / "metrics.jsonl")] == [0, 1, 2]
    ckpts = log_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "3" and (ckpts / "best").read_text() == "1"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]


def test_overwrite_leaves_nothing_of_the_old_run(finished):
    log_dir = _copy(finished, "overwritten")
    (log_dir / "notes.txt").write_text("mine")  # not a run file: kept
    assert _train(log_dir, "bf16.yaml", "train.num_steps=1", "--overwrite") == 0
    assert [r["step"] for r in read_jsonl(log_dir / "metrics.jsonl")] == [0]
    ckpts = log_dir / "checkpoints"
    # No step_000002, no `best` / best.json of the old run (the new one has no eval after a step yet).
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001"]
    assert (ckpts / "latest").read_text() == "1"
    assert "train_recipe: bf16" in (log_dir / "config.yaml").read_text()
    assert (log_dir / "notes.txt").read_text() == "mine"
    assert not list(log_dir.glob(".overwritten_*"))
