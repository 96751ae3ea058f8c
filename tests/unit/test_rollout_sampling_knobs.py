"""rollout.top_k / min_p / stop / stop_token_ids / seed: the embedded engine's behaviour against a
slow reference forward, the loop's mapping of the config, and SGLang's request fields (checked
against SGLang's SamplingParams and served by the server double)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.data import build_char_tokenizer
from megatron_rl.loop import phases
from megatron_rl.rollout import SamplingParams, TorchRolloutEngine
from megatron_rl.rollout.base import trim_at_stop
from megatron_rl.rollout.sglang_engine import _generate_body
from sglang_protocol import sampling_param_names
from sglang_testing import make_engine, needs_sglang_source

PROMPTS = [[1, 5, 6, 7, 8], [1, 20, 21], [1, 30]]


@pytest.fixture(scope="module")
def model_dir(char_model_dir):
    return char_model_dir


@pytest.fixture(scope="module")
def engine(model_dir):
    return TorchRolloutEngine(model_dir)


def _step_probs(engine, prompt, response):
    """Slow reference: one full forward, softmax(logits) [T, V] at each response position (T = 1)."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0].float()
    return torch.softmax(logits[len(prompt) - 1: len(prompt) + len(response) - 1], dim=-1)


def test_top_k_1_equals_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    top1 = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8, n=1, seed=3,
                                                   ignore_eos=True))
    assert [s.response_ids for s in top1] == [s.response_ids for s in greedy]
    for a, b in zip(top1, greedy):
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-6)


@pytest.mark.parametrize("knob", [{"top_k": 3}, {"min_p": 0.3}])
def test_top_k_and_min_p_sample_only_allowed_tokens(engine, knob):
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=8, seed=1, ignore_eos=True, **knob))
    drawn = 0
    for s in samples:
        probs = _step_probs(engine, s.prompt_ids, s.response_ids)
        for t, row in zip(s.response_ids, probs):
            if "top_k" in knob:
                assert int((row > row[t]).sum()) < knob["top_k"]  # rank of the drawn token
            else:
                assert row[t] >= knob["min_p"] * row.max() - 1e-6
            drawn += 1
    assert drawn == 3 * 8 * 6
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, n=8, seed=1, ignore_eos=True))
    assert [s.response_ids for s in free] != [s.response_ids for s in samples]  # the knob changed something


def test_stop_string_ends_the_response_before_it(engine):
    tok = build_char_tokenizer()
    free = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))[0]
    text = tok.decode(free.response_ids)
    stop = text[3:5]  # two characters the greedy response writes at positions 3-4
    first = text.find(stop)
    stopped = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                                                          stop=(stop,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids == free.response_ids[: first + len(stop)]  # tokens through the stop string
    assert trim_at_stop(tok.decode(stopped.response_ids), (stop,)) == text[:first]


def test_seed_reproducible(model_dir, engine):
    params = SamplingParams(max_new_tokens=6, n=4, seed=11, ignore_eos=True)
    assert TorchRolloutEngine(model_dir, seed=99).generate(PROMPTS, params) == engine.generate(PROMPTS, params)
    other = SamplingParams(max_new_tokens=6, n=4, seed=12, ignore_eos=True)
    assert engine.generate(PROMPTS, other) != engine.generate(PROMPTS, params)


class _Recorder:
    def generate(self, prompts, sampling):
        self.sampling = sampling
        return []


def test_loop_maps_the_rollout_section_to_sampling_params():
    cfg = load_config(None, ["rollout.top_k=5", "rollout.min_p=0.05", "rollout.stop=['</answer>']",
                             "rollout.stop_token_ids=[7, 9]", "rollout.seed=77"])
    run = SimpleNamespace(cfg=cfg, tokenizer=SimpleNamespace(eos_token_id=2), engine=_Recorder(),
                          parallel=SimpleNamespace(dp_rank=0))
    phases._generate_on_engine(run, [SimpleNamespace(prompt_ids=[1])], step=3, salt=0)
    got = run.engine.sampling
    assert (got.top_k, got.min_p, tuple(got.stop), tuple(got.stop_token_ids)) == (5, 0.05, ("</answer>",), (2, 7, 9))
    assert got.seed == phases._step_seed(77, 3, 0)
    default = load_config(None, [])
    run.cfg = default
    phases._generate_on_engine(run, [SimpleNamespace(prompt_ids=[1])], step=3, salt=0)
    assert run.engine.sampling.seed == phases._step_seed(default.train.seed, 3, 0) and run.engine.sampling.top_k == -1


def test_bad_sampling_knobs_name_the_key():
    for override, key in (("rollout.top_k=0", "rollout.top_k"), ("rollout.min_p=1.5", "rollout.min_p"),
                          ("rollout.stop=['']", "rollout.stop"), ("rollout.stop_token_ids=[-1]", "rollout.stop_token_ids")):
        with pytest.raises(ValueError, match=f"config key '{key}'"):
            load_config(None, [override])


@needs_sglang_source
def test_sglang_request_carries_the_knobs(model_dir):
    sampling = SamplingParams(top_k=1, min_p=0.1, stop=("ab",), max_new_tokens=4)
    params = _generate_body([(0, [1, 2], 0)], sampling)["sampling_params"]  # one object per request (the router)
    assert {"top_k": 1, "min_p": 0.1, "stop": ["ab"]}.items() <= params.items()
    assert set(params) <= sampling_param_names()  # SGLang 0.5.23's SamplingParams field names
    sg = make_engine(model_dir, num_servers=1)  # the double refuses unknown sampling fields
    try:
        greedy = sg.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
        top1 = sg.generate(PROMPTS, SamplingParams(top_k=1, max_new_tokens=6, ignore_eos=True, seed=4))
        assert [s.response_ids for s in top1] == [s.response_ids for s in greedy]
        stop = build_char_tokenizer().decode(greedy[0].response_ids)[2:4]
        cut = sg.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, stop=(stop,)))
        assert cut[0].finish_reason == "stop" and len(cut[0].response_ids) < 6
    finally:
        sg.shutdown()
