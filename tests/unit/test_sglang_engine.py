"""SGLangEngine against SGLang server doubles on loopback (schemas from the sglang package)."""

from __future__ import annotations

import sys

import pytest
import torch

from sglang_testing import API_KEY, DOUBLES_TIMEOUT_S, free_port_block, make_engine, needs_sglang_source

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_client import SGLangClient, SGLangHTTPError

pytestmark = [needs_sglang_source, pytest.mark.timeout(DOUBLES_TIMEOUT_S)]

PROMPTS = [[3, 17, 42, 5], [9, 9, 1], [60, 2, 33, 7, 11], [4], [80, 81], [5, 6, 7], [12, 13], [99, 1, 2]]


@pytest.fixture(scope="module")
def engine(qwen2_dir, tmp_path_factory):
    """Two server doubles; server 1 crashes inside its first /generate request."""
    marker = tmp_path_factory.mktemp("crash") / "died"
    eng = make_engine(qwen2_dir, num_servers=2, max_batch_per_request=2, requests_per_server=1,
                      extra_by_server={1: ["--die-on-generate-once", str(marker)]})
    eng.crash_marker = marker
    yield eng
    eng.shutdown()


def teacher_forced_logprobs(model_dir, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """Independent reference: one HF forward over prompt + response, log_softmax at T = 1, with the
    weights rounded to float16 (SGLang's --dtype auto serves a float32 checkpoint in float16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16).float().eval()
    out = []
    for prompt, response in rows:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].float(), dim=-1)
        out.append([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)])
    return out


def test_server_dying_mid_rollout_is_restarted_and_requests_retried(engine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=1, ignore_eos=True)
    samples = engine.generate(PROMPTS, sampling)
    assert engine.crash_marker.exists()
    assert [s.prompt_index for s in samples] == [i for i in range(len(PROMPTS)) for _ in range(2)]
    assert all(len(s.response_ids) == 4 and len(s.rollout_logprobs) == 4 for s in samples)
    assert engine.stats["restarts"] == 1 and engine.stats["retries"] >= 1
    assert all(s.client.healthy() and s.version == 0 for s in engine.servers)


def test_generate_returns_real_per_token_logprobs(engine, qwen2_dir):
    samples = engine.generate(PROMPTS[:4], SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=7,
                                                          ignore_eos=True))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(len(s.response_ids) == 5 and s.finish_reason == "length" for s in samples)
    assert len({tuple(s.response_ids) for s in samples[:2]} | {tuple(s.rollout_logprobs) for s in samples[:2]}) > 2
    refs = teacher_forced_logprobs(qwen2_dir, [(s.prompt_ids, s.response_ids) for s in samples[:3]])
    for s, ref in zip(samples, refs):
        assert s.rollout_logprobs == pytest.approx(ref, abs=1e-4)


def test_wrong_api_key_is_refused(engine):
    url = engine.servers[0].url
    bad = SGLangClient(url, "not-the-key", timeout_s=10)
    for path, body in [("/update_weights_from_disk", {"model_path": "/x"}), ("/pause_generation", {}),
                       ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})]:
        with pytest.raises(SGLangHTTPError) as err:
            bad.post(path, body)
        assert err.value.status == 401
    assert bad.healthy("/health")  # SGLang leaves health probes open
    good = SGLangClient(url, API_KEY)
    assert good.post("/pause_generation", {})["status"] == "ok"
    assert good.post("/continue_generation", {})["status"] == "ok"


def test_double_refuses_fields_sglang_does_not_define(engine):
    client = engine.servers[0].client
    with pytest.raises(SGLangHTTPError, match="unknown field"):
        client.post("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                         "weight_versions": "1"})
    with pytest.raises(SGLangHTTPError, match="missing required field 'master_port'"):
        client.post("/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1,
                                                   "world_size": 2})
    with pytest.raises(SGLangHTTPError, match="does not fit"):
        client.post("/pause_generation", {"mode": "sleep"})


def test_restarted_server_serves_nothing_until_the_next_update(engine):
    from megatron_rl.rollout.sglang_engine import RolloutUnavailableError

    engine._version = 3  # as after three weight updates
    for s in engine.servers:
        s.version = 3
    engine.servers[0].process.proc.kill()
    engine.servers[0].process.proc.wait()
    restarts = engine.stats["restarts"]
    with pytest.raises(RolloutUnavailableError, match="re-sync the weights"):
        engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2))
    # server 1 answered, but its samples say weight_version "0": never taken as version 3
    assert engine.stats["restarts"] == restarts + 1
    assert engine.servers[0].version == -1


def test_a_refusal_names_the_server_the_status_why_it_is_not_retried_and_the_answer():
    from megatron_rl.rollout.sglang_engine import _refused_message

    body = "  " + "x" * 600 + "  "
    assert _refused_message("http://n1:30000", SGLangHTTPError("u", 418, body)) == (
        "/generate refused by http://n1:30000 with HTTP 418 (not retried: a client error another attempt "
        f"would repeat); answer: {'x' * 500}")
    message = _refused_message("http://n1:30000", SGLangHTTPError("u", 422, "{}"))
    assert "HTTP 422 (not retried: the request does not fit sglang-router's typed GenerateRequest" in message
    assert message.endswith("; answer: {}")


def test_hf_named_digests_are_refused_with_the_check_that_works():
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    with pytest.raises(NotImplementedError) as refused:
        SGLangEngine.checksum(None, ["model.embed_tokens.weight"])
    assert str(refused.value) == (
        "SGLang fuses (qkv, gate_up) and TP-shards what it holds, so HF-named digests cannot be read back; "
        "the SGLang transports check updates with check_weights() instead")


def test_a_tp2_server_is_never_fed_one_payload_for_all_its_ranks(tmp_path, monkeypatch):
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", API_KEY)
    engine = SGLangEngine(SGLangConfig(num_servers=1, tp_size=2), tmp_path, start=False)  # nothing launched
    with pytest.raises(ValueError, match=r"rollout.sglang.tp_size > 1: every TP rank needs its own payload; use "
                                         r"megatron_rl.sync.sglang_transport.SGLangTensorTransport with a gather"):
        engine.update_weights([("lm_head.weight", torch.zeros(2, 2))], version=1)


class ServerInfo(SGLangClient):
    """A client whose /server_info answers `info` (what a server started elsewhere reports)."""

    def __init__(self, info: dict):
        super().__init__("http://n1:30000", API_KEY)
        self.info = info

    def get(self, path, timeout_s=None):
        assert path == "/server_info"
        return self.info


def test_a_server_that_reports_no_version_is_refused_as_unknown():
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SUPPORTED_VERSIONS, check_server_info
    from megatron_rl.rollout.sglang_server import Server

    with pytest.raises(RuntimeError) as refused:  # a build whose /server_info lacks the field
        check_server_info(Server(ServerInfo({"tp_size": 1, "kv_cache_dtype": "auto"})), SGLangConfig())
    assert str(refused.value) == ("SGLang unknown at http://n1:30000 is not supported: its weight-update protocol "
                                  f"differs from the tested versions {list(SUPPORTED_VERSIONS)}")


def test_a_server_started_with_another_tp_size_is_refused():
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SUPPORTED_VERSIONS, check_server_info
    from megatron_rl.rollout.sglang_server import Server

    info = {"version": SUPPORTED_VERSIONS[0], "tp_size": 2, "kv_cache_dtype": "auto"}
    with pytest.raises(RuntimeError) as refused:
        check_server_info(Server(ServerInfo(info)), SGLangConfig())
    assert str(refused.value) == "SGLang server http://n1:30000 runs tp_size=2 but rollout.sglang.tp_size=1"
    assert check_server_info(Server(ServerInfo(info), tp_size=2), SGLangConfig(tp_size=2)) == SUPPORTED_VERSIONS[0]


def test_a_server_that_exits_at_startup_is_named_with_the_end_of_its_log(tmp_path, monkeypatch):
    """Each launched server writes <log_dir>/sglang_server_<i>.log, and a start that fails says why."""
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", API_KEY)
    exits = [sys.executable, "-c", "import sys; print('error: unrecognized arguments: --bad'); sys.exit(2)"]
    cfg = SGLangConfig(num_servers=1, base_port=free_port_block(1), server_command=exits, startup_timeout_s=60.0)
    with pytest.raises(RuntimeError) as failed:
        SGLangEngine(cfg, "unused", log_dir=tmp_path)
    log = tmp_path / "sglang_server_0.log"
    assert str(failed.value) == (f"SGLang server http://127.0.0.1:{cfg.base_port} exited during startup (exit code 2); "
                                 f"the end of {log}:\nerror: unrecognized arguments: --bad")
