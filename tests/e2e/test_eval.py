"""Evaluation end to end on the tiny model: a planted accuracy (known by a slow independent greedy
loop) at DP=1 and DP=2, FP8 vs BF16 evaluation, and eval + best-checkpoint bookkeeping across a resume."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.telemetry.logger import read_jsonl

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import EXAMPLES, TINY, run_tiny  # noqa: E402
from test_rl_parallel import _free_port  # noqa: E402

NUM_PROBLEMS = 24


def _heldout_file(path: Path) -> Path:
    """Sort prompts drawn here (not by the task generator), answers by Python's sorted()."""
    rng = random.Random(99)
    with path.open("w") as f:
        for _ in range(NUM_PROBLEMS):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            f.write(json.dumps({"prompt": f"sort:{digits}=", "answer": "".join(sorted(digits))}) + "\n")
    return path


def _eval_overrides(tmp_path: Path, **dataset) -> list[str]:
    spec = {"name": "heldout", "path": str(_heldout_file(tmp_path / "heldout.jsonl")), "n_samples": 1,
            "temperature": 0.0, "metrics": ["avg@1", "pass@1"], "reward": "exact_match", **dataset}
    return [*TINY, f"log.dir={tmp_path / 'run'}", "eval.dump_samples=true", "eval.datasets=" + json.dumps([spec])]


def _evaluate(config: str, overrides: list[str], output: Path, checkpoint: str = "") -> dict:
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.loop.evaluate import evaluate_checkpoint

    try:
        return evaluate_checkpoint(load_config(EXAMPLES / config, overrides), checkpoint, output=str(output))
    finally:
        destroy_parallel()


def _reference_greedy(model_dir: Path, problems: list[dict], max_new_tokens: int) -> list[str]:
    """One prompt at a time, no KV cache, no padding: argmax of the full forward at each position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    responses = []
    for p in problems:
        ids = tokenizer(p["prompt"])["input_ids"]
        out = []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                out.append(token)
                if token == tokenizer.eos_token_id:
                    break
        responses.append(tokenizer.decode(out, skip_special_tokens=True))
    return responses


def _dump(folder: Path, suffix: str = "") -> list[dict]:
    (path,) = (folder / "eval_samples").glob(f"step_*_heldout{suffix}.jsonl")
    return read_jsonl(path)


def test_planted_accuracy_at_dp1_and_dp2(tmp_path):
    overrides = _eval_overrides(tmp_path)
    one = _evaluate("bf16.yaml", overrides, tmp_path / "one")
    (model_dir,) = [p for p in (tmp_path / ".tiny_models").iterdir() if p.is_dir()]
    problems = read_jsonl(tmp_path / "heldout.jsonl")
    responses = _reference_greedy(model_dir, problems, max_new_tokens=8)
    correct = [r.strip() == p["answer"] for r, p in zip(responses, problems)]
    accuracy = sum(correct) / len(correct)
    assert 0 < accuracy < 1  # a planted number both ways: some right, some wrong
    assert [d["responses"][0] for d in _dump(tmp_path / "one")] == responses
    m = one["datasets"]["heldout"]
    assert (m["k"], m["n_problems"]) == (1, NUM_PROBLEMS)
    assert m["metrics"]["avg@1"] == m["metrics"]["pass@1"] == pytest.approx(accuracy, abs=1e-12)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "megatron_rl.cli", "eval", str(EXAMPLES / "bf16.yaml"),
           *overrides, "--output", str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "eval_results.json").read_text())["datasets"]["heldout"]
    assert two["n_problems"] == NUM_PROBLEMS
    assert two["metrics"]["avg@1"] == pytest.approx(accuracy, abs=1e-12)  # each rank scored half, then a sum
    assert [d["responses"][0] for d in _dump(tmp_path / "two")] == responses  # both halves, gathered


def _exact(rows: list[dict]) -> tuple[float, float]:
    """(avg@n, pass@n) recomputed from a dump: exact match, pass@n = any sample right."""
    hits = [[r.strip() == row["answer"] for r in row["responses"]] for row in rows]
    return sum(sum(h) / len(h) for h in hits) / len(hits), sum(any(h) for h in hits) / len(hits)


@pytest.mark.parametrize("config, quantized", [("fp8_calibrated.yaml", True), ("bf16.yaml", False)])
def test_fp8_and_bf16_evaluations_differ_only_where_w8a8_changes_tokens(tmp_path, config, quantized):
    overrides = [*_eval_overrides(tmp_path, n_samples=4, temperature=1.0, metrics=["avg@4", "pass@4"]),
                 "eval.precision=both"]
    m = _evaluate(config, overrides, tmp_path / "out")["datasets"]["heldout"]
    rollout, bf16 = _dump(tmp_path / "out"), _dump(tmp_path / "out", "_bf16")
    changed = [a["responses"] != b["responses"] for a, b in zip(rollout, bf16)]
    for rows, metrics in ((rollout, m["metrics"]), (bf16, m["bf16/metrics"])):
        assert (metrics["avg@4"], metrics["pass@4"]) == pytest.approx(_exact(rows), abs=1e-12)
    if quantized:  # same weights, same seeds: only the W8A8 emulation moves tokens
        assert any(changed) and m["metrics"] != m["bf16/metrics"]
    else:
        assert not any(changed) and m["metrics"] == m["bf16/metrics"]


def test_eval_metrics_and_best_checkpoint_continue_across_a_resume(tmp_path):
    ev = ["eval.datasets=" + json.dumps([{"name": "h", "task": "sort", "n_samples": 2, "temperature": 1.0,
                                          "max_examples": 16, "metrics": ["avg@2", "pass@2"]}]),
          "eval.every=2", "eval.at_end=true", "checkpoint.save_every=2", "checkpoint.keep_best=h/avg@2",
          "eval.precision=both"]
    full = run_tiny(tmp_path / "a", "bf16.yaml", "train.num_steps=4", *ev)
    run_tiny(tmp_path / "b", "bf16.yaml", "train.num_steps=2", *ev)  # stopped after step 2's checkpoint
    resumed = run_tiny(tmp_path / "b", "bf16.yaml", "train.num_steps=4", "checkpoint.resume=true", *ev)
    keys = [k for k in full[2] if k.startswith("eval/h/") and not k.endswith("/time")]
    assert {"eval/h/avg@2", "eval/h/pass@2", "eval/h/garbled_rate", "eval/h/truncated_rate"} <= set(keys)
    assert [k for k in full[1] if k.startswith("eval/")] == []  # every=2: nothing at step 1
    for step in (2, 3):
        assert {k: resumed[step][k] for k in keys} == {k: full[step][k] for k in keys}, step
        # bf16 rollouts: the BF16 twin, synced before each evaluation, samples the very same tokens
        diffs = [full[step][k] for k in keys if "/rollout_minus_bf16/" in k]
        assert diffs and all(d == 0.0 for d in diffs), step
    scores = {2: full[2]["eval/h/avg@2"], 4: full[3]["eval/h/avg@2"]}  # the weights of checkpoints 2 and 4
    winner = max(scores, key=lambda s: (scores[s], -s))  # a tie keeps the earlier
    for run in ("a", "b"):
        root = tmp_path / run / "run" / "checkpoints"
        assert (root / "best").read_text() == str(winner)
        record = json.loads((root / "best.json").read_text())
        source = record.pop("source")  # the eval set's settings: a resume continues the record only on the same set
        assert (source["name"], source["max_examples"], source["metrics"]) == ("h", 16, ["avg@2", "pass@2"])
        assert record == {"step": winner, "metric": "h/avg@2", "value": scores[winner]}
    # `megatron-rl eval --checkpoint .../best`: the checkpoint's weights, the training-time numbers
    root = tmp_path / "a" / "run" / "checkpoints"
    out = _evaluate("bf16.yaml", [*TINY, f"log.dir={tmp_path / 'a' / 'run'}", *ev], tmp_path / "a" / "standalone",
                    checkpoint=str(root / "best"))
    assert out["step"] == winner and out["datasets"]["h"]["metrics"]["avg@2"] == scores[winner]
    logged = full[2] if winner == 2 else full[3]
    assert {k: out["datasets"]["h"]["bf16/metrics"][k] for k in ("avg@2", "pass@2")} == \
        {k: logged[f"eval/h/bf16/{k}"] for k in ("avg@2", "pass@2")}


@pytest.mark.timeout(300)
def test_planted_accuracy_through_the_sglang_doubles_behind_the_router(tmp_path, monkeypatch):
    """The same evaluation with rollout.engine=sglang: batched /generate requests to two server
    doubles (real tiny-model forwards on the weights synced into them) through the router double."""
    from sglang_testing import API_KEY
    from test_rl_sglang import sglang_overrides

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", API_KEY)
    overrides = [*_eval_overrides(tmp_path), *sglang_overrides("colocated")]
    m = _evaluate("bf16.yaml", overrides, tmp_path / "out")["datasets"]["heldout"]
    (model_dir,) = [p for p in (tmp_path / ".tiny_models").iterdir() if p.is_dir()]
    problems = read_jsonl(tmp_path / "heldout.jsonl")
    responses = _reference_greedy(model_dir, problems, max_new_tokens=8)
    assert [d["responses"][0] for d in _dump(tmp_path / "out")] == responses
    accuracy = sum(r.strip() == p["answer"] for r, p in zip(responses, problems)) / len(problems)
    assert m["metrics"]["avg@1"] == pytest.approx(accuracy, abs=1e-12)
