"""What the SGLang servers load and what the trainer sends them: FP8 checkpoint, quant spec from its
quantization_config, config-time refusals, DeepGEMM scale mode, K alignment, BF16 wire dtype, the
per-TP-rank payload rule and SGLang's activation quantizer arithmetic."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from megatron_rl.config import PrecisionConfig, load_config
from megatron_rl.fp8.w8a8 import quantize_activation_groups
from megatron_rl.rollout import sglang_checkpoint as ck
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec, quantize_for_rollout


def fake_checkpoint(tmp_path, quantization_config=None, **dims):
    config = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, **dims}
    if quantization_config:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_spec_follows_the_fp8_checkpoint(tmp_path):
    path = fake_checkpoint(tmp_path, {"quant_method": "fp8", "weight_block_size": [32, 64], "scale_fmt": "ue8m0",
                                      "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]})
    spec = ck.spec_from_checkpoint(path, PrecisionConfig(rollout_quant="fp8_blockwise"))
    assert spec.rollout_quant == "fp8_blockwise" and spec.weight_block_size == (32, 64)
    assert spec.scale_format == "ue8m0" and "model.layers.0.mlp.down_proj" in spec.high_precision
    with pytest.raises(ValueError, match="precision.rollout_quant.*is block-FP8"):
        ck.spec_from_checkpoint(path, PrecisionConfig(rollout_quant="bf16"))


def test_bf16_checkpoint_cannot_take_fp8_updates(tmp_path):
    with pytest.raises(ValueError, match="rollout.sglang.model_path.*not quantized.*weight_scale_inv"):
        ck.spec_from_checkpoint(fake_checkpoint(tmp_path), PrecisionConfig(rollout_quant="fp8_blockwise"))


def test_online_fp8_quantization_with_blockwise_updates_is_refused_at_config_time():
    with pytest.raises(ValueError, match="rollout.sglang.quantization.*per channel"):
        load_config(None, ["rollout.engine=sglang", "rollout.sglang.quantization=fp8",
                           "precision.rollout_quant=fp8_blockwise", "precision.train_recipe=blockwise"])


@pytest.mark.parametrize("sm, fmt, block, env, refused", [
    (100, "fp32", (128, 128), "1", True), (90, "fp32", (128, 128), "1", False),
    (100, "ue8m0", (128, 128), "1", False), (100, "fp32", (128, 128), "0", False),
    (120, "fp32", (128, 128), "1", False), (100, "fp32", (32, 32), "1", False)])
def test_fp32_scales_refused_where_deepgemm_requantizes_to_ue8m0(monkeypatch, sm, fmt, block, env, refused):
    monkeypatch.setenv("SGLANG_ENABLE_JIT_DEEPGEMM", env)
    spec = RolloutQuantSpec("fp8_blockwise", block, fmt)
    if refused:
        with pytest.raises(ValueError, match="precision.scale_format.*UE8M0"):
            ck.check_scale_format(spec, sm)
    else:
        ck.check_scale_format(spec, sm)


def test_ragged_k_refused_for_sglang(tmp_path):
    path = fake_checkpoint(tmp_path)  # K = 64 (hidden, heads * head_dim) and 128 (intermediate)
    ck.check_block_alignment(path, RolloutQuantSpec("fp8_blockwise", (32, 32)))
    with pytest.raises(ValueError, match=r"precision.weight_block_size.*'hidden_size': 64"):
        ck.check_block_alignment(path, RolloutQuantSpec("fp8_blockwise", (128, 128)))


def test_a_merged_partition_off_the_block_is_refused_as_sglang_does(tmp_path):
    """qkv_proj's k and v partitions (1 kv head x 16 = 16 rows) must each start on a 32-row scale
    block (validate_block_quant_shapes checks merged partitions at any TP); K (64, 128) fits."""
    path = fake_checkpoint(tmp_path, num_key_value_heads=1)  # head_dim 64 / 4 = 16
    with pytest.raises(ValueError) as err:
        ck.check_block_alignment(path, RolloutQuantSpec("fp8_blockwise", (32, 32)))
    assert "block_n = 32 does not divide the merged output partitions {'k': 16, 'v': 16}" in str(err.value)
    assert "activation groups" not in str(err.value) and "a block that fits: [16, 16]" in str(err.value)
    ck.check_block_alignment(path, RolloutQuantSpec("fp8_blockwise", (16, 16)))


def test_servers_get_an_automatic_fp8_checkpoint(qwen2_dir, tmp_path):
    cfg = load_config(None, ["rollout.engine=sglang", "precision.rollout_quant=fp8_blockwise",
                             "precision.train_recipe=blockwise", "precision.weight_block_size=[32,32]",
                             f"log.dir={tmp_path}"])
    out = ck.rollout_checkpoint(cfg, qwen2_dir)
    assert out == tmp_path / "rollout_fp8"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [32, 32] and qc["quant_method"] == "fp8"
    cfg.precision.rollout_quant = "bf16"
    assert ck.rollout_checkpoint(cfg, qwen2_dir) == qwen2_dir
    cfg.rollout.sglang.model_path = str(out)
    assert ck.rollout_checkpoint(cfg, qwen2_dir) == out


def test_unquantized_tensors_travel_in_bf16_to_sglang():
    cfg = load_config(None, ["rollout.engine=sglang", "precision.rollout_quant=fp8_blockwise",
                             "precision.train_recipe=blockwise", "precision.weight_block_size=[2,2]"])
    spec = ck.rollout_quant_spec(cfg)
    named = [("model.norm.weight", torch.ones(4)), ("model.layers.0.mlp.up_proj.weight", torch.ones(4, 4))]
    out = dict(quantize_for_rollout(named, spec))
    assert out["model.norm.weight"].dtype == torch.bfloat16
    assert out["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.mlp.up_proj.weight_scale_inv"].dtype == torch.float32


def test_tensor_transport_refuses_one_payload_for_several_tp_ranks():
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    engine = types.SimpleNamespace(servers=[types.SimpleNamespace(tp_size=2)])
    transport = SGLangTensorTransport(engine)  # build wires the host's gather after construction
    with pytest.raises(ValueError, match="tp_size > 1.*gather"):
        transport.begin(1)  # ... and without one the first sync is refused before any request


def test_disaggregated_trainer_follows_the_checkpoint_the_servers_load(tmp_path, monkeypatch):
    (tmp_path / "served").mkdir()
    served = fake_checkpoint(tmp_path / "served", {"quant_method": "fp8", "weight_block_size": [64, 64]})
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                             "rollout.sglang.weight_transport=nccl", "precision.rollout_quant=fp8_blockwise",
                             f"log.dir={tmp_path / 'log'}"])
    monkeypatch.setenv("MEGATRON_RL_MODEL", str(served))
    assert ck.rollout_quant_spec(cfg).weight_block_size == (64, 64)  # not precision's 128 x 128
    assert ck.rollout_checkpoint(cfg, tmp_path / "hf") == served  # and no FP8 copy of its own
    assert not (tmp_path / "log" / "rollout_fp8").exists()
    bf16 = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                              "rollout.sglang.weight_transport=nccl", "precision.rollout_quant=bf16"])
    with pytest.raises(ValueError, match="precision.rollout_quant.*is block-FP8"):
        ck.rollout_quant_spec(bf16)


def test_activation_quantizer_matches_sglang_per_token_group_arithmetic():
    x = torch.tensor([[3.0, -1.5, 0.0, 0.0, 0.3, 0.1]])
    q, scale_inv = quantize_activation_groups(x, 2)
    inv448 = np.float32(1.0) / np.float32(448.0)
    expected = [np.float32(3.0) * inv448, np.float32(1e-10) * inv448, np.float32(0.3) * inv448]
    assert scale_inv[0].tolist() == [float(e) for e in expected]  # amax * (1/448), floor 1e-10
    assert q.float()[0].tolist() == [448.0, -224.0, 0.0, 0.0, 448.0, 144.0]
    q8, s8 = quantize_activation_groups(torch.tensor([[3.0, 1.0]]), 2, "ue8m0")
    assert s8.tolist() == [[2.0 ** -7]]  # 3/448 = 0.0067 -> next power of two 2^-7 = 0.0078
    assert q8.float().tolist() == [[384.0, 128.0]]


def test_rollout_wait_of_non_engine_ranks_runs_on_the_gloo_twin(monkeypatch):
    from megatron_rl import collectives
    from megatron_rl.loop import phases

    seen = []
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, src, group: seen.append(group) or obj)
    monkeypatch.setattr(collectives, "global_rank", lambda group, r: 0)
    parallel = types.SimpleNamespace(tp_size=2, pp_size=1, mp_group="nccl-mp-group")
    gloo = collectives.HostGroups(mp="gloo-mp-group", dp=None, world=None)
    assert phases._broadcast_from_engine_rank(["s"], parallel, gloo) == ["s"]
    assert seen == ["gloo-mp-group"]
