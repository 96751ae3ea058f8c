"""The research workflow in the real loop: a user reward from a file with components, sample dumps
equal to the step's batch, response-length metrics, the per-step log line, and data epochs."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from loop_trace import _grpo, trace_run  # noqa: E402

REWARD = textwrap.dedent('''
    def score(response, answer):
        r, a = response.strip(), answer.strip()
        longest = max(len(r), len(a), 1)
        partial = sum(x == y for x, y in zip(r, a)) / longest
        return {"score": partial, "exact": float(r == a), "long": float(len(r) > len(a)), "pred": r}
''')


def _reference(text: str, answer: str) -> dict:
    """The same reward written again, for the expected values."""
    r, a = text.strip(), answer.strip()
    return {"score": sum(x == y for x, y in zip(r, a)) / max(len(r), len(a), 1), "exact": float(r == a),
            "long": float(len(r) > len(a))}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("workflow")  # one warm-started tiny model for both runs


@pytest.fixture(scope="module")
def trace(root):
    (root / "my_reward.py").write_text(REWARD)
    return trace_run(root / "run", "fp8_calibrated.yaml", "train.num_steps=2", f"reward.name={root}/my_reward.py:score",
                     "log.dump_samples_every=1", "log.dump_samples_num=1000", "checkpoint.save_hf_every=2",
                     "checkpoint.save_every=1", "checkpoint.keep_last=1")


def test_dumps_equal_the_steps_batch(trace):
    n = trace.cfg.rollout.n_samples_per_prompt
    prompt_text = {tuple(item.prompt_ids): item.prompt_text for item in trace.dataset}
    for index, step in enumerate(trace.steps):
        (generate,), (score,) = step.of("generate"), step.of("score")
        samples = generate.data["samples"]
        path = Path(trace.cfg.log.dir) / "samples" / f"step_{index:06d}.jsonl"
        dump = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(dump) == len(samples)
        rewards = [_reference(t, a)["score"] for t, a in zip(score.data["texts"], score.data["answers"])]
        for d, s, text, answer, reward, adv in zip(dump, samples, score.data["texts"], score.data["answers"],
                                                   rewards, _grpo(rewards, n)):
            ref = _reference(text, answer)
            assert (d["response"], d["answer"], d["prompt"]) == (text, answer, prompt_text[tuple(s.prompt_ids)])
            assert d["reward"] == pytest.approx(reward, abs=1e-6)
            assert (d["reward/exact"], d["reward/long"]) == (ref["exact"], ref["long"])
            assert d["advantage"] == pytest.approx(adv, abs=1e-5)
            assert (d["response_length"], d["finish_reason"]) == (len(s.response_ids), s.finish_reason)


def test_components_and_length_metrics(trace):
    for step in trace.steps:
        (generate,), (score,) = step.of("generate"), step.of("score")
        samples, m = generate.data["samples"], step.metrics
        refs = [_reference(t, a) for t, a in zip(score.data["texts"], score.data["answers"])]
        assert m["reward/exact"] == pytest.approx(sum(r["exact"] for r in refs) / len(refs), abs=1e-6)
        assert m["reward/long"] == pytest.approx(sum(r["long"] for r in refs) / len(refs), abs=1e-6)
        assert m["response_length/max"] == max(len(s.response_ids) for s in samples)
        truncated = sum(s.finish_reason == "length" for s in samples) / len(samples)
        assert m["response_length/clip_ratio"] == pytest.approx(truncated, abs=1e-6)


def test_step_line_when_the_progress_bar_is_off(root, caplog):
    """log.progress=false (TINY sets it): one line per step, with the step's numbers."""
    with caplog.at_level(logging.INFO, logger="megatron_rl.telemetry"):
        trace = trace_run(root / "lines", "fp8_calibrated.yaml", "train.num_steps=2", "data.num_examples=4",
                          "data.num_epochs=1")
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.telemetry"]
    assert len(trace.steps) == 1 and trace.cfg.train.num_steps == 1  # 4 prompts, 4 per step: one epoch
    assert len(lines) == 1 and lines[0].startswith("step 0/1 reward ")
    assert f"reward {trace.steps[0].metrics['reward/mean']:.4g}" in lines[0]


def test_hf_export_and_retention_in_the_loop(trace):
    from transformers import AutoModelForCausalLM

    log_dir = Path(trace.cfg.log.dir)
    assert sorted(p.name for p in (log_dir / "hf").iterdir()) == ["step_000002"]  # every 2 steps, 2 steps run
    model = AutoModelForCausalLM.from_pretrained(log_dir / "hf" / "step_000002")
    assert model.config.num_hidden_layers == trace.cfg.model.tiny_num_layers
    assert sorted(p.name for p in (log_dir / "checkpoints").glob("step_*")) == ["step_000002"]  # keep_last=1
