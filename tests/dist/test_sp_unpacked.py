"""Sequence parallel without packing on 2 real gloo processes: TP=2 + SP rows whose length is not a
multiple of TP are padded (loss mask 0) and give TP=1's old log-probs and losses at step 0."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _launch import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from loop_trace import trace_run  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# The tiny task (max_new_tokens=8) gives odd row lengths at step 0 (23 tokens).
COMMON = ("train.num_steps=1", "train.max_tokens_per_micro_batch=0")


def _worker(rank: int, world_size: int, log_dir: str, tp: int) -> dict:
    layout = [f"parallel.tensor_model_parallel_size={tp}", f"parallel.sequence_parallel={tp > 1}"]
    trace = trace_run(Path(log_dir), "bf16.yaml", *COMMON, *layout)
    (step,) = trace.steps
    return {"train": [e.data["batch"] for e in step.of("train")],
            "loss": [float(e.data["mb"]["loss_mask"].sum()) for e in step.of("loss")],
            "metrics": {k: v for k, v in step.metrics.items() if k.startswith(("mismatch/", "loss", "reward/"))}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sp")
    tp1 = run_distributed(_worker, world_size=1, args=(str(root / "tp1"), 1), timeout_s=600)[0]
    tp2 = run_distributed(_worker, world_size=2, args=(str(root / "tp2"), 2), timeout_s=600)
    return {"tp1": tp1, "tp2": tp2}


def test_tp2_sp_unpacked_equals_tp1_at_step_0(runs):
    ref, (r0, r1) = runs["tp1"], runs["tp2"]
    assert len(ref["train"]) == len(r0["train"]) == len(r1["train"]) > 0
    assert any(b["tokens"].shape[1] % 2 for b in ref["train"]), "the case needs odd row lengths"
    for want, got in zip(ref["train"], r0["train"]):
        rows, cols = want["tokens"].shape
        assert got["tokens"].shape[1] % 2 == 0  # padded to the SP multiple
        assert torch.equal(got["tokens"][:rows, :cols], want["tokens"])
        assert float(got["loss_mask"][:, cols:].abs().sum()) == 0.0  # the padding adds no loss term
        on = want["loss_mask"] > 0
        torch.testing.assert_close(got["old_logprobs"][:rows, :cols][on], want["old_logprobs"][on],
                                   rtol=1e-4, atol=1e-4)
    assert ref["loss"] == r0["loss"] == r1["loss"]  # same response tokens in every micro-batch
    for key, value in ref["metrics"].items():
        assert r0["metrics"][key] == pytest.approx(value, rel=1e-3, abs=1e-4), key
