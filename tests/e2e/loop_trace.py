"""Run the real loop (megatron_rl.train.run) with spies at the components' public calls.

The orchestration tests need to see what each phase fed to the next: which weights a forward ran
at, what the optimizer trained on, what the engine served, and the state of every component when
a step is logged. Spies record and then call the real method, so the run is the real run.

    trace = trace_run(root / "name", "fp8_calibrated.yaml", "train.num_steps=3")
    trace.steps[1].events      # [Event(kind="generate", ...), Event(kind="logprobs", ...), ...]
    trace.steps[1].state       # controller, loader, engine, trainer digests after step 1
    trace.initial              # the same snapshot right after build, before the start-up sync

Event kinds: "prompts" (the global batch the loader handed out), "generate" (engine version it
served, its prompts and samples), "score" (texts, answers, rewards), "logprobs" (fp8 flag, rows), "train" (the mini-batch handed to train_step), "loss"
(one micro-batch's log-probs and inputs as the loss saw them, and the loss it returned). `updates` is the number of
optimizer steps taken before the event, counted over the whole run.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.loop import build
from megatron_rl.config import load_config
from megatron_rl.rewards import get_reward_fn
from megatron_rl.fp8.rollout_quant import quantize_for_rollout
from megatron_rl.sync.transport import tensor_digest

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import EXAMPLES, TINY  # noqa: E402


@dataclass
class Event:
    kind: str
    updates: int
    data: dict[str, Any]


@dataclass
class Step:
    metrics: dict[str, float] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


@dataclass
class Trace:
    cfg: Any
    initial: dict[str, Any] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    dataset: list = field(default_factory=list)  # the run's PromptItems (prompt_ids, answer)
    tokenizer: Any = None


def digest_tensors(named) -> str:
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode() + tensor_digest(t).encode())
    return h.hexdigest()


def _optimizer_tensors(state, prefix: str = ""):
    """Every tensor of a (nested) optimizer state dict, with a path name, in a fixed order."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key in sorted(state, key=str):
            yield from _optimizer_tensors(state[key], f"{prefix}/{key}")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _optimizer_tensors(value, f"{prefix}/{i}")


def snapshot(run_, weights: bool = False) -> dict[str, Any]:
    """What a step may change: controller, data cursor, engine, trainer weights and optimizer.
    Collective under TP / PP (the weight export gathers): every rank takes it at the same point.
    weights: also the full (gathered) HF weights, unquantized, as {name: tensor}."""
    exported = [(n, t.detach().clone()) for n, t in run_.actor.export_hf_weights()] if weights else None
    sent = quantize_for_rollout(iter(exported) if weights else run_.actor.export_hf_weights(), run_.sync.quant)
    return {**({"weights": dict(exported)} if weights else {}),
        "controller": dict(run_.controller.state_dict()),
        "loader": dict(run_.loader.state_dict()),
        "sync_version": run_.sync.version,
        "engine_version": None if run_.engine is None else run_.engine.weight_version,
        "engine_sums": None if run_.engine is None else run_.engine.checksum(),
        "trainer_sums": {n: tensor_digest(t) for n, t in sent},
        "params": digest_tensors(p for c in run_.actor.model for p in c.named_parameters()),
        "optimizer": digest_tensors(_optimizer_tensors(run_.actor.optimizer.state_dict())),
    }


def _copy(batch: dict) -> dict:
    """A snapshot of a batch dict: later phases may write into the one the loop holds."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class _Spy:
    """Installs the spies on a built run; `pending` collects the events of the running step."""

    def __init__(self, run_, trace: Trace, weights: bool = False) -> None:
        self.pending, self.updates = [], 0
        actor, engine = run_.actor, run_.engine
        self.engine = engine
        self._wrap(actor, "compute_logprobs", self._logprobs)
        self._wrap(actor, "train_step", self._train)
        if engine is not None:  # the engine rank only (TP rank 0 and PP rank 0)
            self._wrap(engine, "generate", self._generate)
        self._wrap(run_.rewards, "score", self._score)
        self._wrap(run_.loader, "next_batch", self._prompts)
        logger_log = run_.logger.log

        def log(step: int, metrics: dict[str, float]) -> None:
            trace.steps.append(Step(dict(metrics), self.pending, snapshot(run_, weights)))
            self.pending = []
            logger_log(step, metrics)
        run_.logger.log = log

    def _record(self, kind: str, **data) -> None:
        self.pending.append(Event(kind, self.updates, data))

    @staticmethod
    def _wrap(obj, name: str, spy) -> None:
        real = getattr(obj, name)
        signature = inspect.signature(real)

        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return spy(real, bound)
        setattr(obj, name, wrapper)

    def _logprobs(self, real, bound):
        self._record("logprobs", fp8=bound.arguments["fp8"], rows=bound.arguments["batch"]["tokens"].shape[0])
        return real(*bound.args, **bound.kwargs)

    def _train(self, real, bound):
        batch, loss_fn = bound.arguments["batch"], bound.arguments["loss_fn"]
        self._record("train", batch=_copy(batch))

        def spied_loss(logprobs, entropy, mb):
            self._record("loss", logprobs=logprobs.detach().clone(), mb=_copy(mb))
            event = self.pending[-1]
            loss, metrics = loss_fn(logprobs, entropy, mb)
            event.data["loss"] = float(loss.detach())  # what the backward ran on
            return loss, metrics
        bound.arguments["loss_fn"] = spied_loss
        result = real(*bound.args, **bound.kwargs)
        self.updates += 0 if result["skipped"] else 1
        return result

    def _generate(self, real, bound):
        version = self.engine.weight_version  # the weights these samples are drawn from
        samples = real(*bound.args, **bound.kwargs)
        self._record("generate", version=version, prompt_ids=[list(p) for p in bound.arguments["prompts"]],
                     samples=samples)
        return samples

    def _prompts(self, real, bound):
        items = real(*bound.args, **bound.kwargs)
        self._record("prompts", prompt_ids=[list(item.prompt_ids) for item in items])
        return items

    def _score(self, real, bound):
        rewards, stats = real(*bound.args, **bound.kwargs)
        self._record("score", texts=list(bound.arguments["responses"]), answers=list(bound.arguments["answers"]),
                     rewards=list(rewards))
        return rewards, stats


def _grpo(rewards: list[float], n: int) -> list[float]:
    """Slow reference: (r - group mean) / (unbiased group std + 1e-6); equal rewards give 0."""
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g: g + n]
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        out += [0.0 if max(group) == min(group) else (r - mean) / (std + 1e-6) for r in group]
    return out


def check_sample_flow(trace: Trace, step: Step) -> list[float]:
    """Assert that every response this rank drew in `step` was trained exactly once (none of a group
    that dynamic sampling drops, none past the first data.prompts_per_step kept groups of a refilled
    step: one process), with the reward of its own prompt's answer (reward fn called here), its
    group's GRPO advantage, and its tokens, mask and rollout log-probs as generated.
    Returns this rank's rewards, every round's."""
    n = trace.cfg.rollout.n_samples_per_prompt
    answers = {tuple(item.prompt_ids): item.answer for item in trace.dataset}
    reward_fn = get_reward_fn(build.reward_name(trace.cfg))  # the run's: reward.name, else the task's
    expected: dict[tuple, list] = {}
    all_rewards, kept_groups = [], 0
    for generate, score in zip(step.of("generate"), step.of("score"), strict=True):  # refill: rounds
        samples = generate.data["samples"]
        texts = trace.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        rewards = [reward_fn(t, answers[tuple(s.prompt_ids)]) for t, s in zip(texts, samples)]
        assert score.data["rewards"] == pytest.approx(rewards, abs=0)
        all_rewards += rewards
        for i, (s, adv) in enumerate(zip(samples, _grpo(rewards, n))):
            group = rewards[i - i % n: i - i % n + n]
            if trace.cfg.algo.dynamic_sampling and max(group) == min(group):
                continue  # DAPO dynamic sampling: the whole group is dropped, never trained
            kept_groups += i % n == 0
            if kept_groups > trace.cfg.data.prompts_per_step:
                continue  # the rest of the last refill round: discarded
            expected.setdefault(tuple(s.prompt_ids) + tuple(s.response_ids), []).append((s, adv))
    for e in step.of("train"):
        mb = e.data["batch"]
        for row in range(mb["tokens"].shape[0]):
            on = torch.nonzero(mb["loss_mask"][row]).flatten()
            if len(on) == 0:
                continue  # padding row
            key = tuple(mb["tokens"][row, : int(on[-1]) + 1].tolist())
            assert expected.get(key), "trained a response twice, or one of a dropped group"
            s, adv = expected[key].pop()
            p, r = len(s.prompt_ids), len(s.response_ids)
            assert on.tolist() == list(range(p, p + r))
            assert mb["rollout_logprobs"][row, p: p + r].tolist() == pytest.approx(s.rollout_logprobs, abs=0)
            assert mb["advantages"][row, p: p + r].tolist() == pytest.approx([adv] * r, abs=1e-5)
    assert not [k for k, left in expected.items() if left], "a response was never trained"
    return all_rewards


def trace_run(log_dir: Path, config: str, *overrides: str, setup=None, weights: bool = False) -> Trace:
    """megatron_rl.train.run on the tiny config with spies; `setup(run_)` runs right after build;
    weights: every snapshot also holds the full HF weights (snapshot)."""
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.train import run

    # The trace reads the trainer's parameters between steps, where the colocated protocol has them
    # offloaded (0-byte storages): the protocol's own order is tested in test_colocated.py.
    cfg = load_config(EXAMPLES / config, [*TINY, f"log.dir={log_dir}", "train.colocated_protocol=false",
                                          *overrides])
    trace = Trace(cfg)
    real_build = build.build_run

    def build_and_spy(cfg_):
        run_ = real_build(cfg_)
        if setup is not None:
            setup(run_)
        trace.initial = snapshot(run_, weights)
        trace.dataset = [run_.loader.dataset[i] for i in range(len(run_.loader.dataset))]
        trace.tokenizer = run_.tokenizer
        _Spy(run_, trace, weights)
        return run_

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "build_run", build_and_spy)
        try:
            run(cfg)
        finally:
            destroy_parallel()
    return trace
