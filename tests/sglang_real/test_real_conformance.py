"""Each SGLang double against the real server: the same scenario on both, the same observable answers
(status codes, the messages the project matches, meta_info fields, version strings).

The server double (tests/doubles/sglang_server_double.py) is checked here on what both show on CPU;
what only a GPU shows (CUDA IPC, discarded weights, CUDA graphs, seeded sampling) stays the double's
own, with its SGLang source lines. The router double is checked in test_real_router.py.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import real_sglang
from megatron_rl.rollout.sglang_client import SGLangClient, SGLangHTTPError, ServerUnavailable
from megatron_rl.rollout.sglang_payload import flatten_bucket, serialize_flattened
from sglang_testing import API_KEY, start_double


@pytest.fixture(scope="module")
def double(real_model):
    proc, url = start_double(real_model, "--weight-version", "0", *real_sglang.CPU_ARGS)  # --dtype float32 too
    yield SGLangClient(url, API_KEY, timeout_s=60)
    proc.kill()
    proc.wait()


@pytest.fixture
def both(real_engine, double):
    """(name, client) of the real server and of the double, each holding the checkpoint's weights."""
    real = SGLangClient(real_engine.servers[0].url, real_sglang.API_KEY, timeout_s=60)
    pairs = [("real", real), ("double", double)]
    for _, client in pairs:
        _load(client, _checkpoint(real_engine), "conformance")
    return pairs


def _checkpoint(engine) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    (shard,) = sorted(p for p in _model_dir(engine).glob("*.safetensors"))
    return sorted(load_file(str(shard)).items())


def _model_dir(engine):
    from pathlib import Path

    return Path(engine.servers[0].client.get("/model_info")["model_path"])


_SENT: list[torch.Tensor] = []  # CPU payloads are shared-memory files: alive until the module ends


def _payload(named) -> str:
    flat, meta = flatten_bucket(named)
    _SENT.append(flat)
    return serialize_flattened(flat, meta)


def _load(client: SGLangClient, named, version: str) -> None:
    client.post("/begin_weight_update")
    client.post("/update_weights_from_tensor", {"serialized_named_tensors": [_payload(named)],
                                                "load_format": "flattened_bucket", "flush_cache": False,
                                                "weight_version": version})
    client.post("/end_weight_update")
    client.post("/flush_cache")


def _answer(call):
    """(status, body) of one call; an HTTP error is an answer, a dropped connection is "gone"."""
    try:
        return 200, call()
    except SGLangHTTPError as err:
        try:
            return err.status, json.loads(err.body)  # compared as JSON: the spacing differs
        except ValueError:
            return err.status, err.body
    except ServerUnavailable:
        return "gone", None


def _on_both(both, scenario) -> dict:
    return {name: scenario(client) for name, client in both}


def test_update_sessions_answer_alike(both, real_engine):
    lm_head = [(n, t) for n, t in _checkpoint(real_engine) if n == "lm_head.weight"]
    body = {"serialized_named_tensors": [_payload(lm_head)], "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": "s1"}

    def scenario(c: SGLangClient):
        return [_answer(lambda: c.post("/update_weights_from_tensor", body)),
                _answer(lambda: c.post("/end_weight_update")),
                _answer(lambda: c.post("/begin_weight_update")),
                _answer(lambda: c.post("/begin_weight_update")),
                _answer(lambda: c.post("/update_weights_from_tensor", body)),
                _answer(lambda: c.post("/end_weight_update")),
                c.get("/model_info")["weight_version"],
                _answer(lambda: c.post("/update_weight_version", {"new_version": "s2"})),
                c.get("/model_info")["weight_version"]]

    out = _on_both(both, scenario)
    assert out["double"] == out["real"]
    # the messages the engine matches (open_sessions: "already open") and the version strings
    assert out["real"][3] == (400, {"success": False, "message": "a weight-update session is already open; "
                                                                 "call end_weight_update() first"})
    assert out["real"][6] == "s1" and out["real"][8] == "s2"


def test_the_key_guards_every_route_but_health_alike(both):
    def scenario(c: SGLangClient):
        anonymous = SGLangClient(c.url, "wrong-key", timeout_s=30)
        gets = [_answer(lambda p=p: anonymous.get(p)) for p in ("/health", "/health_generate", "/server_info",
                                                                  "/model_info")]
        posts = [_answer(lambda p=p: anonymous.post(p, {})) for p in ("/flush_cache", "/begin_weight_update",
                                                                      "/generate")]
        return [(status, body if status == 401 else None) for status, body in gets + posts]

    out = _on_both(both, scenario)
    assert out["double"] == out["real"]
    assert [s for s, _ in out["real"]] == [200, 200, 401, 401, 401, 401, 401]


def test_generate_answers_the_same_tokens_log_probs_and_meta_info(both):
    requests = [
        {"input_ids": [1, 5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
         "return_logprob": True},
        {"input_ids": [[1, 8, 9], [1, 12, 30]], "return_logprob": True, "logprob_start_len": -1,
         "sampling_params": {"temperature": 0.0, "max_new_tokens": 5}},
    ]

    def scenario(c: SGLangClient):
        out = []
        for req in requests:
            answer = c.post("/generate", req)
            for item in answer if isinstance(answer, list) else [answer]:
                meta = item["meta_info"]
                out.append({"output_ids": item["output_ids"], "finish_reason": meta["finish_reason"],
                            "weight_version": meta["weight_version"], "prompt_tokens": meta["prompt_tokens"],
                            "completion_tokens": meta["completion_tokens"],
                            "logprob_ids": [e[1] for e in meta["output_token_logprobs"]],
                            "logprob_text": [e[2] for e in meta["output_token_logprobs"]],
                            "logprobs": [e[0] for e in meta["output_token_logprobs"]]})
        return out

    out = _on_both(both, scenario)
    for real, double in zip(out["real"], out["double"], strict=True):
        assert double.pop("logprobs") == pytest.approx(real.pop("logprobs"), abs=2e-4)
        assert double == real
    assert out["real"][0]["weight_version"] == "conformance"


def test_stop_token_ids_end_a_sample_only_without_ignore_eos(both):
    def scenario(c: SGLangClient):
        free = c.post("/generate", {"input_ids": [1, 8, 9], "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}})["output_ids"]
        out = [free]
        for ignore in (False, True):
            item = c.post("/generate", {"input_ids": [1, 8, 9], "sampling_params": {
                "temperature": 0.0, "max_new_tokens": 8, "ignore_eos": ignore, "stop_token_ids": [free[2]]}})
            out.append((item["output_ids"], item["meta_info"]["finish_reason"]))
        return out

    out = _on_both(both, scenario)
    assert out["double"] == out["real"]
    free, stopped, ignored = out["real"]
    assert ignored == (free, {"type": "length", "length": 8})
    assert stopped[1]["type"] == "stop" and stopped[0][-1] == stopped[1]["matched"]


LONG = {"input_ids": [1, 5, 6, 7], "sampling_params": {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}}


def _running(c: SGLangClient) -> bool:
    status, _ = _answer(lambda: c.post("/flush_cache"))
    return status == 400


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_and_flush_refusals_answer_alike(both, mode):
    """A request inside: flush refused; paused in `mode`: what flush answers and how the request ends."""
    def scenario(c: SGLangClient):
        out: list = []
        thread = threading.Thread(target=lambda: out.append(c.post("/generate", LONG)), daemon=True)
        thread.start()
        refused = real_sglang.wait_for(lambda: _answer(lambda: c.post("/flush_cache"))[0] == 400 and
                                       _answer(lambda: c.post("/flush_cache")), 30, "a request inside")
        paused = _answer(lambda: c.post("/pause_generation", {"mode": mode}))
        flushed = _answer(lambda: c.post("/flush_cache"))
        time.sleep(0.3)
        answered_while_paused = bool(out)
        resumed = _answer(lambda: c.post("/continue_generation"))
        thread.join(60)
        meta = out[0]["meta_info"]
        reason = {k: v for k, v in meta["finish_reason"].items() if k != "length"}
        return [refused, paused, flushed, answered_while_paused, resumed, reason]

    out = _on_both(both, scenario)
    assert out["double"] == out["real"]
    expected_flush = 400 if mode == "in_place" else 200
    assert out["real"][0] == (400, "Flush cache failed.\n") and out["real"][2][0] == expected_flush
    assert out["real"][5]["type"] == ("abort" if mode == "abort" else "length")


def test_server_info_reports_the_version_and_flags_the_engine_checks(both):
    def scenario(c: SGLangClient):
        info = c.get("/server_info")
        return {k: info.get(k) for k in ("version", "tp_size", "kv_cache_dtype", "random_seed")}

    out = _on_both(both, scenario)
    assert out["double"] == out["real"] == {"version": "0.5.23", "tp_size": 1, "kv_cache_dtype": "auto",
                                            "random_seed": 0}
