"""train._train on 2 real gloo ranks (tests/doubles/toy_loop.py: the real loop, Checkpointer and
best-checkpoint bookkeeping around a toy trainer), a stop request seen by ONE rank in the middle of
the run: rank 0's request stops both ranks after the same step with one published checkpoint and the
requeue file; rank 1's alone stops nobody. The stopped run resumed on both ranks trains the rest, and
the evaluation at the top of the resumed step pairs with the stop's checkpoint (it becomes `best`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))

SETTINGS = ["train.num_steps=6", "checkpoint.save_every=4", "checkpoint.keep_last=0", "eval.every=3",
            "checkpoint.keep_best=h/avg@1"]
SCORES = {3: 0.7, 6: 0.2}


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    import torch.distributed as dist

    from toy_loop import run_loop

    dist.init_process_group("gloo")
    out = {}
    for trigger, resume in ((1, False), (0, False), (0, True)):
        request = os.path.join(tmp, f"stop_{trigger}_{rank}")
        os.environ["MEGATRON_RL_STOP_REQUEST"] = request
        os.environ["MEGATRON_RL_STOP_FILE"] = os.path.join(tmp, f"requeue_{trigger}")
        if resume and os.path.exists(request):
            os.remove(request)

        def on_step(step, trigger=trigger, request=request, resume=resume):
            if step == 2 and rank == trigger and not resume:
                open(request, "w").close()
        with pytest.MonkeyPatch.context() as mp:
            run, ev, stepped = run_loop(Path(tmp) / f"run_{trigger}", mp,
                                        [*SETTINGS, f"checkpoint.resume={str(resume).lower()}"], SCORES, on_step,
                                        rank=rank, world_size=world_size)
        dist.barrier()  # rank 0's publish is on disk for every rank's look
        root = run.checkpointer.root
        out[(trigger, resume)] = {"stepped": stepped, "scored": ev.scored,
                                  "on_disk": sorted(p.name for p in root.glob("step_*")),
                                  "latest": run.checkpointer.latest_step()}
    return {str(k): v for k, v in out.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop_dist")
    return run_distributed(_worker, 2, args=(str(tmp),), timeout_s=180), tmp


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


def test_rank_ones_request_alone_stops_nobody(ranks):
    results, tmp = ranks
    for r in results:
        assert r["(1, False)"] == {"stepped": [0, 1, 2, 3, 4, 5], "scored": [3],
                                   "on_disk": ["step_000004", "step_000006"], "latest": 6}
    root = tmp / "run_1" / "checkpoints"
    assert _steps(root) == ["step_000004", "step_000006"] and (root / "latest").read_text() == "6"
    assert not (root / "best").exists()  # weights 3 were never checkpointed
    assert not (tmp / "requeue_1").exists()


def test_rank_zeros_request_stops_both_after_the_same_step_with_one_checkpoint(ranks):
    results, tmp = ranks
    for r in results:
        assert r["(0, False)"] == {"stepped": [0, 1, 2], "scored": [], "on_disk": ["step_000003"], "latest": 3}
    assert (tmp / "requeue_0").read_text() == "3\n"


def test_the_resumed_run_trains_the_rest_and_pairs_its_first_eval_with_the_stops_checkpoint(ranks):
    results, tmp = ranks
    for r in results:
        assert r["(0, True)"] == {"stepped": [3, 4, 5], "scored": [3],
                                  "on_disk": ["step_000003", "step_000004", "step_000006"], "latest": 6}
    root = tmp / "run_0" / "checkpoints"
    assert _steps(root) == ["step_000003", "step_000004", "step_000006"]
    assert (root / "best").read_text() == "3" and (root / "latest").read_text() == "6"
