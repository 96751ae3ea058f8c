"""Value tests of loop/build.py's data and reward decisions: for every crossing of prompts x
prompts_per_step x num_epochs x num_steps x DP size, the steps the run keeps and what its loader
serves (each prompt num_epochs times when the epochs fill whole batches), and which reward runner an
eval dataset gets when the run's reward is a user's batched function (batched only for that very
name). Expected values are by hand."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.config import load_config
from megatron_rl.data import build_char_tokenizer
from megatron_rl.loop import build

TOKENIZER = build_char_tokenizer()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.sampled_from([1, 2, 3, 4]), st.integers(0, 3), st.integers(1, 12), st.sampled_from([1, 2]))
def test_the_steps_a_run_keeps_and_the_prompts_its_loader_serves(num_examples, per_step, epochs, num_steps, dp):
    cfg = load_config(None, [f"data.num_examples={num_examples}", f"data.prompts_per_step={per_step}",
                             f"data.num_epochs={epochs}", f"train.num_steps={num_steps}"])
    parallel = SimpleNamespace(dp_size=dp, rank=0)
    full = epochs * num_examples // per_step  # whole batches in the epochs (the last partial one dropped)
    if per_step % dp:
        with pytest.raises(ValueError, match=rf"config key 'data.prompts_per_step': {per_step} is not divisible"):
            build.build_data(cfg, TOKENIZER, parallel)
        return
    if epochs and full == 0:
        with pytest.raises(ValueError, match=r"config key 'data.num_epochs'"):
            build.build_data(cfg, TOKENIZER, parallel)
        return
    loader = build.build_data(cfg, TOKENIZER, parallel)
    steps = min(num_steps, full) if epochs else num_steps
    assert cfg.train.num_steps == steps
    served = Counter(p.index for _ in range(steps) for p in loader.next_batch())
    assert sum(served.values()) == steps * per_step
    if epochs and steps == full and (epochs * num_examples) % per_step == 0:
        assert served == Counter({i: epochs for i in range(num_examples)})  # every prompt once per epoch
    if epochs and steps == full:
        with pytest.raises(StopIteration):
            loader.next_batch()
    if steps * per_step <= num_examples:  # within the first epoch no prompt comes twice
        assert max(served.values()) == 1


def test_an_eval_dataset_gets_the_users_batched_reward_only_under_its_own_name(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def score(responses, answers, **kw):\n"
        "    return [float(len(responses)) for _ in responses]\n")
    name = f"{tmp_path / 'mine.py'}:score"
    cfg = load_config(None, [f"reward.name={name}", "reward.batched=true", "reward.num_workers=3"])
    runners = {key: build.build_rewards(cfg, key) for key in ("", name, "exact_match")}
    try:
        assert {k: (r.batched, len(r.workers)) for k, r in runners.items()} == {
            "": (True, 3), name: (True, 3), "exact_match": (False, 3)}
        assert runners[""].score(["a", "b", "c"], ["", "", ""])[0] == [3.0, 3.0, 3.0]  # the batch at once
        assert runners["exact_match"].score(["a", "b"], ["a", "a"])[0] == [1.0, 0.0]
    finally:
        for r in runners.values():
            r.close()
