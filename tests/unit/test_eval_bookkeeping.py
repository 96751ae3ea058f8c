"""checkpoint.keep_best bookkeeping (scores pair with checkpoints of the same weights, survive a restart)
and built-in held-out eval sets (disjoint from the training and warm-start prompts)."""

import json

from megatron_rl.config import load_config
from megatron_rl.data.tasks import make_task_dataset
from megatron_rl.loop.best import BestCheckpoint
from megatron_rl.loop.evaluate import held_out_records


def _best(root):
    return (root / "best").read_text(), json.loads((root / "best.json").read_text())


def test_a_score_waits_for_its_checkpoint_and_only_a_higher_one_replaces_it(tmp_path):
    best = BestCheckpoint(tmp_path, "h/avg@4")
    best.scored(0, {"eval/h/avg@4": 0.9}, latest_step=0)  # at_start: no checkpoint holds these weights
    assert not (tmp_path / "best").exists()
    best.scored(2, {"eval/h/avg@4": 0.5}, latest_step=0)  # at_end: its checkpoint comes after
    best.saved(2)
    assert _best(tmp_path) == ("2", {"step": 2, "metric": "h/avg@4", "value": 0.5})
    best.scored(4, {"eval/h/avg@4": 0.7}, latest_step=4)  # top of step 4: checkpoint 4 already saved
    best.scored(6, {"eval/h/avg@4": 0.6}, latest_step=6)
    assert _best(tmp_path)[0] == "4"


def test_the_record_survives_a_restart(tmp_path):
    BestCheckpoint(tmp_path, "h/avg@4").scored(4, {"eval/h/avg@4": 0.7}, latest_step=4)
    again = BestCheckpoint(tmp_path, "h/avg@4")  # a resumed run
    assert again.step == 4
    again.scored(6, {"eval/h/avg@4": 0.6}, latest_step=6)  # lower than the saved record
    assert _best(tmp_path)[0] == "4"
    other = BestCheckpoint(tmp_path, "h/pass@4")  # another metric: a new record
    assert other.step is None


def test_only_rank_zero_writes(tmp_path):
    BestCheckpoint(tmp_path, "h/avg@4", enabled=False).scored(2, {"eval/h/avg@4": 1.0}, latest_step=2)
    assert not (tmp_path / "best").exists()


def test_built_in_held_out_prompts_are_disjoint_from_training_and_warm_start():
    cfg = load_config(None, ["data.task=sort", "data.num_examples=512", "train.sft_steps=10",
                             "train.sft_batch_size=32"])
    heldout = [r["prompt"] for r in held_out_records(cfg, "sort", 200)]
    train = {r["prompt"] for r in make_task_dataset("sort", 512, seed=cfg.train.seed)}
    sft = {r["prompt"] for r in make_task_dataset("sort", 320, seed=cfg.train.seed + 1)}
    assert len(heldout) == len(set(heldout)) == 200
    assert not set(heldout) & (train | sft)
