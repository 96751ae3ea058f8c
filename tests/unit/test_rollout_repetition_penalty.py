"""rollout.repetition_penalty: the embedded engine against a slow reference that applies SGLang's rule
by hand (a generated token's logit / p when positive, x p when negative; prompt tokens untouched),
the loop's mapping of the config, SGLang's request field, and its range checked at load."""


import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.rollout import SamplingParams, TorchRolloutEngine
from megatron_rl.rollout.sglang_engine import row_sampling_params
from sglang_protocol import sampling_param_names
from sglang_testing import needs_sglang_source

PROMPTS = [[1, 5, 6, 7, 8], [1, 20, 21, 20, 20], [1, 30]]
STEPS = 10


@pytest.fixture(scope="module")
def engine(char_model_dir):
    return TorchRolloutEngine(char_model_dir)


def _reference_greedy(engine, prompt, penalty):
    """One full forward per token, no cache; the penalty applied to the tokens generated so far."""
    out, logprobs = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = engine.model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
            for token in set(out):
                value = float(logits[token])
                logits[token] = value / penalty if value > 0 else value * penalty
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            out.append(token)
    return out, logprobs


@pytest.mark.parametrize("penalty", [1.8, 0.5])
def test_greedy_with_a_penalty_matches_the_reference(engine, penalty):
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True, repetition_penalty=penalty)
    plain = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True))
    samples = engine.generate(PROMPTS, params)
    for prompt, sample in zip(PROMPTS, samples):
        tokens, logprobs = _reference_greedy(engine, prompt, penalty)
        assert sample.response_ids == tokens
        assert sample.rollout_logprobs == pytest.approx(logprobs, abs=1e-5)
    assert [s.response_ids for s in samples] != [s.response_ids for s in plain]  # the knob changed something


def test_sampling_with_a_penalty_avoids_repeats(engine):
    """At p = 2 and T = 0.3 a repeated token needs twice its logit margin: fewer repeats than without."""
    def repeats(penalty):
        params = SamplingParams(temperature=0.3, max_new_tokens=STEPS, n=8, seed=5, ignore_eos=True,
                                repetition_penalty=penalty)
        return sum(len(s.response_ids) - len(set(s.response_ids)) for s in engine.generate(PROMPTS, params))
    assert repeats(2.0) < repeats(1.0)


def test_the_config_reaches_sampling_params_and_is_range_checked():
    from types import SimpleNamespace

    from megatron_rl.loop import phases

    class Recorder:
        def generate(self, prompts, sampling):
            self.sampling = sampling
            return []

    cfg = load_config(None, ["rollout.repetition_penalty=1.2"])
    run = SimpleNamespace(cfg=cfg, tokenizer=SimpleNamespace(eos_token_id=2), engine=Recorder())
    phases._generate_on_engine(run, [SimpleNamespace(prompt_ids=[1])], step=0, salt=0)
    assert run.engine.sampling.repetition_penalty == 1.2
    assert load_config(None, []).rollout.repetition_penalty == 1.0
    for bad in ("0", "2.5", "-1"):
        with pytest.raises(ValueError, match="config key 'rollout.repetition_penalty': must be in \\(0, 2\\]"):
            load_config(None, [f"rollout.repetition_penalty={bad}"])
    with pytest.raises(ValueError, match="config key 'eval.datasets\\[0\\].repetition_penalty'"):
        load_config(None, ['eval.datasets=[{name: h, task: sort, repetition_penalty: 3.0}]'])
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0.0)


@needs_sglang_source
def test_sglang_gets_the_penalty_in_its_sampling_params():
    params = row_sampling_params((0, [1], 0), SamplingParams(repetition_penalty=1.3))
    assert params["repetition_penalty"] == 1.3 and set(params) <= sampling_param_names()
    assert "repetition_penalty" not in row_sampling_params((0, [1], 0), SamplingParams())  # off: SGLang's default
