"""Value tests of checkpoints and what the loop pairs with them: which steps train.py saves and
evaluates for every crossing of save_every x save_final x eval.every x at_end x num_steps, which
score becomes `best` (only checkpointed weights compete; a tie keeps the earlier), retention at its
exact boundaries (N complete folders, `best` or `latest` among the newest, step numbers past six
digits), and resume reading the folder `latest` names even when a newer complete one exists.

The loop runs for real (train._train) around stand-ins for the trainer and the engine
(tests/doubles/toy_loop.py); the Checkpointer, BestCheckpoint, Run.save_due, the evaluator's schedule
and the loop's order are the real ones. Expected values are by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.loop.best import BestCheckpoint
from megatron_rl.loop.checkpoint import Checkpointer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from toy_loop import ToyActor, run_loop  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _saved(run) -> list[int]:
    root = run.checkpointer.root
    return sorted(int(p.name[5:]) for p in root.glob("step_*")) if root.exists() else []


def _expected_saves(num_steps, every, final):
    return sorted({s for s in range(1, num_steps + 1) if every and s % every == 0} | ({num_steps} if final else set()))


def _expected_evals(num_steps, every, at_start, at_end):
    tops = [s for s in range(num_steps) if (s == 0 and at_start) or (every and s > 0 and s % every == 0)]
    return tops + ([num_steps] if at_end else [])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 7), st.integers(0, 4), st.booleans(), st.integers(0, 3), st.booleans(), st.booleans())
def test_the_loop_saves_and_evaluates_exactly_the_documented_steps(tmp_path_factory, num_steps, save_every, save_final,
                                                                   eval_every, at_start, at_end):
    with pytest.MonkeyPatch.context() as mp:  # one per example: function fixtures are not reset between them
        run, ev, stepped = run_loop(tmp_path_factory.mktemp("loop"), mp, [
            f"train.num_steps={num_steps}", f"checkpoint.save_every={save_every}",
            f"checkpoint.save_final={str(save_final).lower()}", "checkpoint.keep_last=0", f"eval.every={eval_every}",
            f"eval.at_start={str(at_start).lower()}", f"eval.at_end={str(at_end).lower()}"])
    assert stepped == list(range(num_steps))
    assert _saved(run) == _expected_saves(num_steps, save_every, save_final)
    for s in _saved(run):  # each checkpoint holds the weights after s updates
        assert json.loads((run.checkpointer.root / f"step_{s:06d}" / "model" / "weights.json").read_text()) == s
    assert ev.scored == _expected_evals(num_steps, eval_every, at_start, at_end)


@pytest.mark.parametrize("overrides, scores, best, latest", [
    # eval every 2 on checkpoints every 2: weights 6 tie with 4, the earlier stays best
    (["eval.every=2", "checkpoint.save_every=2"], {2: 0.5, 4: 0.7, 6: 0.7, 7: 0.1}, 4, 7),
    # eval every 3, saves every 2: the 0.9 of weights 3 has no checkpoint; at_end scores the final
    # one, after the final publish pruned: the old best (6) goes all the same
    (["eval.every=3", "checkpoint.save_every=2", "eval.at_end=true"], {3: 0.9, 6: 0.4, 7: 0.5}, 7, 7),
    # at_start scores weights 0, which no checkpoint holds
    (["eval.every=2", "eval.at_start=true", "checkpoint.save_every=2"], {0: 1.0, 2: 0.2, 4: 0.1, 6: 0.3}, 6, 7),
    # the final save is the only pairing of at_end
    (["eval.every=0", "eval.at_end=true", "checkpoint.save_every=0"], {7: 0.3}, 7, 7),
    # the last eval (top of step 6) moves best to 6 after the last save: 4 is not kept
    (["eval.every=2", "checkpoint.save_every=2", "checkpoint.save_final=false"], {2: 0.1, 4: 0.2, 6: 0.3}, 6, 6),
])
def test_best_is_the_highest_score_of_checkpointed_weights(tmp_path, monkeypatch, overrides, scores, best, latest):
    run, ev, _ = run_loop(tmp_path, monkeypatch, ["train.num_steps=7", "checkpoint.keep_best=h/avg@1",
                                               "checkpoint.keep_last=1", *overrides], scores)
    root = run.checkpointer.root
    assert (root / "best").read_text() == str(best)
    state = json.loads((root / "best.json").read_text())
    assert (state["step"], state["metric"], state["value"]) == (best, "h/avg@1", scores[best])
    assert (state["source"]["name"], state["source"]["task"]) == ("h", "sort")  # the eval set it was measured on
    assert _saved(run) == sorted({best, latest})  # keep_last=1 spares the best besides the latest, no other


def test_a_pending_score_waits_for_its_own_checkpoint_and_ignores_others(tmp_path):
    best = BestCheckpoint(tmp_path, "h/avg@1")
    best.scored(4, {"eval/h/avg@1": 0.9}, latest_step=2)  # checkpoint 4 not written yet
    best.saved(3)
    assert best.step is None
    best.saved(4)
    assert best.step == 4 and (tmp_path / "best").read_text() == "4"
    best.saved(4)  # a second publish of the same step does not re-score it
    best.scored(0, {"eval/h/avg@1": 5.0}, latest_step=0)  # at_start: no checkpoint 0 exists
    best.saved(0)
    assert best.step == 4


def test_a_record_of_another_metric_is_not_continued(tmp_path):
    BestCheckpoint(tmp_path, "h/avg@1").scored(2, {"eval/h/avg@1": 0.9}, latest_step=2)
    other = BestCheckpoint(tmp_path, "h/pass@1")
    assert other.best is None
    other.scored(4, {"eval/h/pass@1": 0.1}, latest_step=4)
    assert json.loads((tmp_path / "best.json").read_text()) == {"step": 4, "metric": "h/pass@1", "value": 0.1}
    same = BestCheckpoint(tmp_path, "h/pass@1")
    same.scored(6, {"eval/h/pass@1": 0.1}, latest_step=6)  # a tie with the resumed record
    assert same.step == 4


class _Run(SimpleNamespace):
    pass


def _ckpt_run(updates: int):
    actor = ToyActor()
    actor.updates = updates
    return _Run(parallel=SimpleNamespace(rank=0, world_size=1), actor=actor,
                loader=SimpleNamespace(state_dict=lambda: {"pos": updates}, load_state_dict=lambda s: None),
                controller=SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda s: None),
                sync=SimpleNamespace(version=updates + 1))


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


@pytest.mark.parametrize("keep, saves, marked, left", [
    (3, [1, 2, 3], None, [1, 2, 3]),  # exactly N: none deleted
    (3, [1, 2, 3, 4], None, [2, 3, 4]),  # N + 1: only the oldest
    (2, [1, 2, 3, 4], 4, [3, 4]),  # best among the newest: nothing extra kept
    (2, [1, 2, 3, 4], 1, [1, 3, 4]),
    (1, [999_999, 1_000_000], None, [1_000_000]),  # seven digits sort after six
    (5, [7], None, [7]),
])
def test_retention_keeps_the_n_newest_complete_checkpoints(tmp_path, keep, saves, marked, left):
    root = tmp_path / "c"
    if marked is not None:
        root.mkdir()
        (root / "best").write_text(str(marked))
    ckpt = Checkpointer(root, keep_last=keep)
    for s in saves:
        ckpt.save(_ckpt_run(s), s)
    assert _steps(root) == [f"step_{s:06d}" for s in left]
    assert ckpt.latest_step() == saves[-1] and ckpt.complete_steps() == left


def test_resume_reads_the_folder_latest_names_not_the_newest(tmp_path):
    ckpt = Checkpointer(tmp_path / "c")
    for s in (1, 2, 3):
        ckpt.save(_ckpt_run(s), s)
    (ckpt.root / "latest").write_text("2\n")  # killed after step 3's rename, before `latest` moved
    fresh = _ckpt_run(0)
    assert ckpt.load_latest(fresh) == 2
    assert fresh.actor.updates == 2 and fresh.sync.version == 2  # saved version 3, re-published at start
    assert Checkpointer(tmp_path / "c", keep_last=1).prune() == [1]  # the newest and the one `latest` names stay
    ckpt.save(_ckpt_run(30), 3)  # the resumed run redoes step 3: its folder is replaced, not merged
    assert json.loads((ckpt.root / "step_000003" / "model" / "weights.json").read_text()) == 30


def test_two_folders_of_one_step_number_are_one_checkpoint_and_a_leftover_tmp_is_spared(tmp_path):
    root = tmp_path / "c"
    ckpt = Checkpointer(root, keep_last=1)
    for s in (10, 20):
        ckpt.save(_ckpt_run(s), s)
    # the same step number under another spelling (copied by hand, or by an older release): not the
    # folder load_latest reads, so neither counted nor deleted
    (root / "step_000020").rename(root / "step_20")
    ckpt.save(_ckpt_run(20), 20)  # and a re-save of step 20 (a resumed run redoing it)
    (root / "step_000030.tmp").mkdir()  # a killed save of the next step
    assert ckpt.complete_steps() == [20]
    ckpt.save(_ckpt_run(30), 30)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_000030", "step_20"]
    assert ckpt.complete_steps() == [30] and ckpt.latest_step() == 30


@pytest.mark.parametrize("change, continued", [
    ([], True),  # the same eval set: the resumed run keeps comparing with the record
    (["eval.every=3"], True),  # the schedule is not what is measured
    (["eval.datasets=[{name: h, task: sort, max_examples: 8}]"], False),  # same name, other problems
    (["eval.datasets=[{name: h, task: reverse}]"], False),
    (["eval.datasets=[{name: h, task: sort, temperature: 0.7}]"], False),
])
def test_a_resumed_record_is_continued_only_for_the_same_eval_set_not_the_same_name(tmp_path, monkeypatch, change,
                                                                                     continued):
    common = ["checkpoint.keep_best=h/avg@1", "checkpoint.save_every=2", "eval.every=2", "train.num_steps=4"]
    run_loop(tmp_path, monkeypatch, common, {2: 0.9, 4: 0.1})
    root = tmp_path / "checkpoints"
    assert (root / "best").read_text() == "2"
    # the relaunch trains 4 more steps; its scores (0.5 at step 6) are below the old set's 0.9
    with pytest.MonkeyPatch.context() as mp:
        run_loop(tmp_path, mp, [*common, "train.num_steps=8", "checkpoint.resume=true", *change],
                 {4: 0.2, 6: 0.5, 8: 0.3})
    assert (root / "best").read_text() == ("2" if continued else "6")


def test_a_record_written_before_sources_were_kept_is_continued(tmp_path):
    (tmp_path / "best.json").write_text(json.dumps({"step": 2, "metric": "h/avg@1", "value": 0.9}))
    best = BestCheckpoint(tmp_path, "h/avg@1", source={"name": "h", "task": "sort"})
    assert best.step == 2
    best.scored(4, {"eval/h/avg@1": 0.5}, latest_step=4)
    assert best.step == 2
