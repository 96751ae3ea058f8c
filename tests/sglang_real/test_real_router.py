"""sglang-router 0.3.2 (PyPI, in the server's virtual environment) in front of two real servers: the
engine's generate through it, and the router double checked against it on what both show."""

from __future__ import annotations

import pytest

import real_sglang
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_client import SGLangClient, SGLangHTTPError, ServerUnavailable
from sglang_testing import API_KEY, ROUTER_COMMAND, free_port_block, start_double
from test_sglang_real_engine import PROMPTS, greedy, push


@pytest.fixture(scope="module")
def second_server(real_model, tmp_path_factory):
    """A second real server, launched the way build_servers launches one (its own start here)."""
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    cfg = real_sglang.sglang_config(base_port=free_port_block(1), mode="disaggregated", weight_transport="nccl")
    engine = SGLangEngine(cfg, real_model, seed=1, log_dir=tmp_path_factory.mktemp("second_server"))
    yield engine.servers[0]
    engine.shutdown()


def _router_engine(real_engine, second_server, command, log_dir):
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    cfg = real_sglang.sglang_config(server_urls=[real_engine.servers[0].url, second_server.url],
                                    launch_router=True, router_port=free_port_block(1), router_command=command,
                                    mode="disaggregated", weight_transport="nccl", startup_timeout_s=120)
    return SGLangEngine(cfg, "unused: the servers run already", log_dir=log_dir)


@pytest.fixture(scope="module")
def routers(real_engine, second_server, tmp_path_factory):
    """{"real": engine through sgl-router, "double": engine through the router double}, same workers."""
    engines = {name: _router_engine(real_engine, second_server, command, tmp_path_factory.mktemp(f"router_{name}"))
               for name, command in (("real", real_sglang.router_command()), ("double", ROUTER_COMMAND))}
    yield engines
    for engine in engines.values():
        engine.shutdown()


def test_generate_through_sgl_router_reaches_both_servers_with_the_synced_weights(routers):
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    engine = routers["real"]
    push(SGLangTensorTransport(engine), engine, seed=21)  # both servers, each directly
    prompts = [PROMPTS[i % 3] + [10 + i] for i in range(12)]
    samples = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True))
    assert [s.response_ids for s in samples] == [greedy(21, p, 5)[0] for p in prompts]
    served = [s.client.get("/server_info") for s in engine.servers]
    assert all(info["version"] == "0.5.23" for info in served)


def _answer(call):
    try:
        return 200, call()
    except SGLangHTTPError as err:
        return err.status, None
    except ServerUnavailable:
        return "gone", None


def test_the_router_double_answers_as_sgl_router(routers):
    """Statuses of: a typed /generate, a list of sampling_params (sgl-model-gateway refuses it, 422,
    before a worker sees it), a request without the key (401), /health without the key (open)."""
    body = {"input_ids": [[1, 5, 6], [1, 7]], "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
            "return_logprob": True}

    def scenario(engine):
        router = engine.router
        anonymous = SGLangClient(router.url, "wrong-key", timeout_s=30)
        ok = router.post("/generate", body)
        return [[item["output_ids"] for item in ok], [item["meta_info"]["weight_version"] for item in ok],
                _answer(lambda: router.post("/generate", {**body, "sampling_params": [body["sampling_params"]] * 2}))[0],
                _answer(lambda: anonymous.post("/generate", body))[0],
                _answer(lambda: anonymous.get("/health"))[0]]

    out = {name: scenario(engine) for name, engine in routers.items()}
    assert out["double"] == out["real"]
    assert out["real"][2:] == [422, 401, 200]


def test_a_resume_of_a_tag_not_released_ends_the_server_as_in_the_double(second_server, real_model):
    """SGLang's scheduler raises KeyError (offload_tags.remove) and an exception there ends the whole
    server; the double does the same. Last in this module: the second server is gone after it."""
    proc, url = start_double(real_model)
    double = SGLangClient(url, API_KEY, timeout_s=30)
    try:
        for client in (second_server.client, double):
            assert _answer(lambda: client.post("/resume_memory_occupation", {"tags": ["weights"]})) == ("gone", None)
            real_sglang.wait_for(lambda: not client.healthy("/health"), 60, f"{client.url} to end")
    finally:
        proc.kill()
        proc.wait()
