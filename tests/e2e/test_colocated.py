"""The colocated memory protocol in the real CPU loop: the calls on the embedded engine and the
actor come in the order design.md section 10 prescribes, with packed micro-batches on."""

from __future__ import annotations

import pytest
from test_rl_loop import run_tiny

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.rollout.torch_engine import TorchRolloutEngine
from megatron_rl.sync.weight_sync import WeightSync

RECORDED = {
    TorchRolloutEngine: ("generate", "release_memory", "resume_memory", "finish_update"),
    MegatronActor: ("compute_logprobs", "train_step", "offload", "reload", "save_checkpoint"),
    WeightSync: ("sync",),
}
# One RL step: rollout, engine out, trainer in, old log-probs (+ BF16 shadow), two PPO
# mini-batches, trainer state out, engine weights in, sync, parameters out, KV cache in.
STEP = ["generate", "release_memory(('weights', 'kv_cache', 'cuda_graph'))", "reload", "compute_logprobs", "compute_logprobs",
        "train_step", "train_step", "offload(('grads', 'optimizer'))", "resume_memory(('weights',))",
        "sync", "finish_update", "offload(('params',))", "resume_memory(('kv_cache', 'cuda_graph'))"]


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Wraps the real methods: each call is recorded (with its tags / groups), then runs."""
    log: list[str] = []
    for cls, names in RECORDED.items():
        for name in names:
            original = getattr(cls, name)

            def wrapper(self, *args, _original=original, _name=name, **kwargs):
                shown = args[0] if args and isinstance(args[0], tuple) else None
                log.append(_name if _name not in ("release_memory", "resume_memory", "offload")
                           else f"{_name}({shown!r})" if shown else f"{_name}()")
                return _original(self, *args, **kwargs)
            monkeypatch.setattr(cls, name, wrapper)
    return log


def test_colocated_protocol_order_in_the_loop(tmp_path, calls):
    records = run_tiny(tmp_path, "fp8_calibrated.yaml", "train.num_steps=2", "calib.period=1",
                       "train.max_tokens_per_micro_batch=96",
                       "checkpoint.save_final=true")
    assert [r["step"] for r in records] == [0, 1] and all(r["step/skipped"] == 0 for r in records)
    start = ["offload(('grads', 'optimizer'))", "sync", "finish_update", "offload(('params',))"]
    # Old log-probs, then the BF16 shadow at theta_old on the calibration rows (both before any
    # update); the BF16 forward at the current weights right before the calibration mini-batch's
    # update (the last one); its FP8 ratio comes from that update's own forward.
    step = STEP[:6] + ["compute_logprobs"] + STEP[6:]
    # The final save: the engine's KV cache and graphs out, trainer in, then out again, KV cache back.
    end = ["release_memory(('kv_cache', 'cuda_graph'))", "reload", "save_checkpoint", "offload()",
           "resume_memory(('kv_cache', 'cuda_graph'))"]
    assert calls == start + step + step + end
    assert records[-1]["memory/trainer_offloaded_gb"] > 0 and records[-1]["sync/check_mismatches"] == 0
