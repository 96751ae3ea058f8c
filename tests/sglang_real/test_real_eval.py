"""`megatron-rl eval` with rollout.engine=sglang against the real server: the run's own build path
(build_run -> build_sglang), its weight sync over gloo (/init_weights_update_group, then
update_weights_from_distributed), batched generation and scoring; the accuracy is planted by an
independent greedy loop over the same weights."""

from __future__ import annotations

import json
import random

import pytest
import torch

import real_sglang
from sglang_testing import free_port_block

NUM_PROBLEMS = 16


def _heldout(path):
    rng = random.Random(7)
    with path.open("w") as f:
        for _ in range(NUM_PROBLEMS):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 5)))
            f.write(json.dumps({"prompt": f"sort:{digits}=", "answer": "".join(sorted(digits))}) + "\n")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _reference(model_dir, problems, max_new_tokens: int) -> list[str]:
    """Greedy answers of the checkpoint with its weights rounded to bf16 (rollout_quant=bf16 sends them
    so), computed in float32 as the server does (--dtype float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    out = []
    for p in problems:
        ids, answer = tokenizer(p["prompt"])["input_ids"], []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                token = int(model(torch.tensor([ids + answer])).logits[0, -1].argmax())
                answer.append(token)
                if token == tokenizer.eos_token_id:
                    break
        out.append(tokenizer.decode(answer, skip_special_tokens=True))
    return out


def test_eval_through_the_real_server_scores_the_planted_accuracy(real_engine, real_model, monkeypatch,
                                                                  parallel_restored):
    from megatron_rl.loop.evaluate import evaluate_checkpoint
    from megatron_rl.telemetry.logger import read_jsonl

    root = real_model.parents[1]  # <root>/.tiny_models/<model>: a run under <root> finds it
    problems = _heldout(root / "heldout.jsonl")
    spec = {"name": "heldout", "path": str(root / "heldout.jsonl"), "n_samples": 1, "temperature": 0.0,
            "metrics": ["avg@1", "pass@1"], "reward": "exact_match", "max_new_tokens": 8}
    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", real_sglang.API_KEY)
    cfg = real_sglang.tiny_config(
        f"log.dir={root / 'eval_run'}", "eval.dump_samples=true", "eval.datasets=" + json.dumps([spec]),
        "rollout.engine=sglang", "rollout.sglang.mode=disaggregated", "rollout.sglang.weight_transport=nccl",
        "rollout.sglang.server_urls=" + json.dumps([real_engine.servers[0].url]),
        f"rollout.sglang.nccl_master_port={free_port_block(1)}", "rollout.sglang.request_timeout_s=120")
    result = evaluate_checkpoint(cfg, output=str(root / "eval_out"))  # parallel_restored tears down after
    responses = _reference(real_model, problems, 8)
    (dump,) = (root / "eval_out" / "eval_samples").glob("step_*_heldout.jsonl")
    assert [row["responses"][0] for row in read_jsonl(dump)] == responses
    accuracy = sum(r.strip() == p["answer"] for r, p in zip(responses, problems)) / NUM_PROBLEMS
    assert 0 < accuracy < 1  # planted both ways
    assert result["datasets"]["heldout"]["metrics"]["avg@1"] == pytest.approx(accuracy, abs=1e-12)
