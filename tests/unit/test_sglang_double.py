"""The SGLang server double behaves as sglang 0.5.23 does (name mapping, sessions, auth, pause/flush,
memory release); expected values are written out by hand from SGLang's source."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang_testing import API_KEY, DOUBLES_TIMEOUT_S, start_double

import sglang_weights_double as W
from megatron_rl.rollout.sglang_client import SGLangClient, SGLangHTTPError
from megatron_rl.rollout.sglang_payload import flatten_bucket, serialize_flattened

pytestmark = pytest.mark.timeout(DOUBLES_TIMEOUT_S)
L = "model.layers.0."


def checkpoint(q_rows=4, kv_rows=2, cols=4, fp8_block=None):
    """A one-layer attention+MLP checkpoint; with fp8_block=(bn, bk) the q/k/v linears are FP8 + scales."""
    ck = {}
    for shard, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        ck[f"{L}self_attn.{shard}.weight"] = torch.zeros(rows, cols)
        if fp8_block:
            ck[f"{L}self_attn.{shard}.weight"] = ck[f"{L}self_attn.{shard}.weight"].to(torch.float8_e4m3fn)
            ck[f"{L}self_attn.{shard}.weight_scale_inv"] = torch.ones(rows // fp8_block[0], -(-cols // fp8_block[1]))
    ck[f"{L}mlp.gate_proj.weight"] = torch.zeros(3, cols)
    ck[f"{L}mlp.up_proj.weight"] = torch.zeros(3, cols)
    ck[f"{L}self_attn.o_proj.weight"] = torch.zeros(cols, q_rows)
    return ck


def fp8_config(block):
    return {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}


def test_fused_layout_places_each_shard_at_its_rows():
    params = W.build_params(checkpoint(), {})
    assert sorted(params) == [f"{L}mlp.gate_up_proj.weight", f"{L}self_attn.o_proj.weight",
                              f"{L}self_attn.qkv_proj.weight"]
    W.load_weights("qwen3", params, [(f"{L}self_attn.k_proj.weight", torch.full((2, 4), 7.0)),
                                     (f"{L}mlp.up_proj.weight", torch.full((3, 4), 5.0))])
    qkv = params[f"{L}self_attn.qkv_proj.weight"].data
    assert qkv.shape == (8, 4) and qkv[4:6].eq(7.0).all()  # q rows 0-3, k rows 4-5, v rows 6-7
    assert params[f"{L}mlp.gate_up_proj.weight"].data[3:].eq(5.0).all()  # gate 0-2, up 3-5


def test_scale_on_a_bf16_server_kills_qwen3_and_is_dropped_by_qwen2_and_llama():
    scale = [(f"{L}self_attn.q_proj.weight_scale_inv", torch.ones(1, 1))]
    with pytest.raises(W.LoadError, match="KeyError: 'model.layers.0.self_attn.qkv_proj.weight_scale_inv'"):
        W.load_weights("qwen3", W.build_params(checkpoint(), {}), scale)
    assert W.load_weights("qwen2", W.build_params(checkpoint(), {}), scale) == [
        f"{L}self_attn.qkv_proj.weight_scale_inv"]
    assert W.load_weights("llama", W.build_params(checkpoint(), {}), scale) == [
        f"{L}self_attn.qkv_proj.weight_scale"]  # llama.py renames weight_scale_inv first


def test_block_fp8_checkpoint_has_scale_params_at_block_rows():
    params = W.build_params(checkpoint(q_rows=4, kv_rows=2, fp8_block=(2, 4)), fp8_config((2, 4)))
    scale = params[f"{L}self_attn.qkv_proj.weight_scale_inv"]
    assert scale.data.shape == (4, 1)  # (4 + 2 + 2) rows / bn=2
    W.load_weights("qwen3", params, [(f"{L}self_attn.v_proj.weight_scale_inv", torch.tensor([[3.0]]))])
    assert scale.data[:, 0].tolist()[3] == 3.0  # v starts at row 6 = scale row 3
    fp8 = torch.full((2, 4), 2.0).to(torch.float8_e4m3fn)
    W.load_weights("qwen3", params, [(f"{L}self_attn.k_proj.weight", fp8)])
    assert params[f"{L}self_attn.qkv_proj.weight"].data.dtype == torch.float8_e4m3fn


def test_block_fp8_shard_not_divisible_by_block_is_refused_at_start():
    with pytest.raises(W.LoadError, match="output_partition_size = 2 is not divisible by weight quantization block_n = 4"):
        W.build_params(checkpoint(q_rows=4, kv_rows=2, fp8_block=(2, 4)), fp8_config((4, 4)))


def test_hf_names_come_back_from_the_fused_layout():
    params = W.build_params(checkpoint(), {})
    W.load_weights("qwen2", params, checkpoint().items())  # the server's start: all zeros
    W.load_weights("qwen2", params, [(f"{L}self_attn.v_proj.weight", torch.full((2, 4), 9.0))])
    hf = dict(W.to_hf(params))
    assert set(hf) == set(checkpoint())
    assert hf[f"{L}self_attn.v_proj.weight"].eq(9.0).all() and hf[f"{L}self_attn.k_proj.weight"].eq(0).all()


# ---- the HTTP process -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(qwen3_dir):
    proc, url = start_double(qwen3_dir, "--tp-size", "2", "--weight-version", "0",
                             "--mem-fraction-static", "0.5", "--health-generate-s", "1.5")
    yield SGLangClient(url, API_KEY, timeout_s=60)
    proc.kill()
    proc.wait()


def payload(name: str, tensor: torch.Tensor) -> str:
    flat, meta = flatten_bucket([(name, tensor)])
    return serialize_flattened(flat, meta)


def test_every_route_but_health_needs_the_key(server):
    anonymous = SGLangClient(server.url, "wrong", timeout_s=10)
    assert anonymous.healthy("/health") and anonymous.healthy("/health_generate") is not None
    for path in ("/server_info", "/model_info", "/flush_cache", "/begin_weight_update"):
        with pytest.raises(SGLangHTTPError) as err:
            anonymous.post(path, {})
        assert err.value.status == 401
    assert server.get("/server_info")["version"] == "0.5.23"


def test_weight_updates_outside_a_session_are_refused(server):
    body = {"serialized_named_tensors": [payload("lm_head.weight", torch.zeros(128, 64))] * 2,
            "load_format": "flattened_bucket", "flush_cache": False}
    with pytest.raises(SGLangHTTPError, match="must run between begin_weight_update"):
        server.post("/update_weights_from_tensor", body)
    with pytest.raises(SGLangHTTPError, match="no weight-update session is open"):
        server.post("/end_weight_update", {})
    assert server.post("/begin_weight_update", {})["success"]
    with pytest.raises(SGLangHTTPError, match="already open"):
        server.post("/begin_weight_update", {})
    with pytest.raises(SGLangHTTPError, match="shared by several TP ranks"):
        server.post("/update_weights_from_tensor", {**body, "weight_version": "5"})
    per_rank = [payload("lm_head.weight", torch.zeros(128, 64)) for _ in range(2)]
    assert server.post("/update_weights_from_tensor", {**body, "serialized_named_tensors": per_rank,
                                                       "weight_version": "5"})["success"]
    assert server.post("/end_weight_update", {})["success"]
    out = server.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["weight_version"] == "5" and server.get("/model_info")["weight_version"] == "5"


def test_flush_is_refused_while_a_health_probe_runs(server):
    probe = threading.Thread(target=server.healthy, args=("/health_generate", 10.0))
    probe.start()
    time.sleep(0.5)
    with pytest.raises(SGLangHTTPError) as err:
        server.post("/flush_cache")
    assert err.value.status == 400 and err.value.body == "Flush cache failed.\n"  # http_server.py:1036
    probe.join()
    assert server.post("/flush_cache").startswith("Cache flushed")


def test_generate_is_refused_while_memory_is_released_and_waits_while_paused(server):
    server.post("/release_memory_occupation", {"tags": ["weights"]})
    with pytest.raises(SGLangHTTPError, match="memory released"):
        server.post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
    server.post("/resume_memory_occupation", {"tags": ["weights"]})
    server.post("/pause_generation", {"mode": "abort"})
    done = []
    waiter = threading.Thread(target=lambda: done.append(server.post(
        "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})))
    waiter.start()
    time.sleep(0.5)
    assert not done  # held until continue_generation
    server.post("/continue_generation", {})
    waiter.join(30)
    assert done and len(done[0]["output_ids"]) == 1
