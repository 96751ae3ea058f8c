"""train._train's loop around stand-ins: the trainer's 'weights' are its number of updates (a save
writes them, a load reads them back), a step adds one, the evaluator scores the weights the engine
holds from a table; the Checkpointer, BestCheckpoint, Run.save_due and the evaluator's schedule are
the real ones, so the loop decides what is saved, evaluated and kept. Works on one process or on
every rank of a gloo group (the Checkpointer's barriers and gathers then run for real)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from megatron_rl import train
from megatron_rl.config import load_config
from megatron_rl.loop import build, evaluate
from megatron_rl.loop.checkpoint import Checkpointer


class ToyActor:
    """The trainer's 'weights' are the number of updates so far; a save writes them."""

    def __init__(self):
        self.updates, self.lr = 0, 1e-6
        self.scheduler = SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda s: None)

    def save_checkpoint(self, folder: Path, async_save: bool = False):
        (folder / "weights.json").write_text(json.dumps(self.updates))

    def load_checkpoint(self, folder: Path) -> None:
        self.updates = json.loads((folder / "weights.json").read_text())


class _Stateless:
    """The loader's and the controller's place in rl_state.pt (their own state is tested elsewhere)."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class ToyLogger:
    def __init__(self):
        self.history, self.logged = [], []

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))

    def close(self):
        pass

    def summary(self):
        return ""


class ToyEvaluator(evaluate.Evaluator):
    """The real schedule (due); evaluate() returns the score table's value for the weights it is
    given and records which weights it scored."""

    def __init__(self, run, scores):
        super().__init__(run, [])
        self.scores, self.scored = scores, []

    def evaluate(self, step, memory=None, dump_dir=None):
        self.scored.append(step)
        assert step == self.run.actor.updates, "the eval must score the weights the engine holds"
        return {"eval/h/avg@1": self.scores.get(step, 0.0)}

    def close(self):
        pass


def run_loop(tmp_path, monkeypatch, overrides, scores=None, on_step=None, rank=0, world_size=1):
    """Run train._train; returns (run, evaluator, steps trained). `on_step(step)` runs at the start
    of each step (a trigger: a stop request file, say)."""
    cfg = load_config(None, [f"log.dir={tmp_path}", "checkpoint.resume=false", "train.colocated_protocol=false",
                             "log.plot=false", "eval.datasets=[{name: h, task: sort}]", *overrides])
    actor, stepped = ToyActor(), []
    run = build.Run(cfg, SimpleNamespace(rank=rank, tp_rank=0, pp_rank=0, world_size=world_size), None,
                    _Stateless(), actor, None,
                    SimpleNamespace(transport=None, wait_for_owners=False, wait_group=None, version=0,
                                    sync=lambda: {}, close=lambda: None),
                    SimpleNamespace(close=lambda: None), _Stateless(), ToyLogger(),
                    Checkpointer(Path(cfg.log.dir) / "checkpoints", keep_last=cfg.checkpoint.keep_last))
    holder = {}

    def step(run_, step, memory):
        if on_step is not None:
            on_step(step)
        assert actor.updates == step
        actor.updates += 1
        stepped.append(step)
        return {}

    def make_evaluator(run_):
        holder["e"] = ToyEvaluator(run_, scores or {})
        return holder["e"]

    monkeypatch.setattr(train, "job_cluster", lambda: None)
    monkeypatch.setattr(train.build, "build_run", lambda cfg: run)
    monkeypatch.setattr(train.evaluate.Evaluator, "build", staticmethod(make_evaluator))
    monkeypatch.setattr(train, "_step", step)
    train._train(cfg)
    return run, holder["e"], stepped
