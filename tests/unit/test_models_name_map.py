"""Name map and reshape helpers: layouts written out by hand, HF names from transformers itself."""

import pytest
import torch

from megatron_rl.models import name_map, reshape
from megatron_rl.models.hf_config import ModelSpec
from megatron_rl.models.tiny import make_tiny_hf_model, tiny_hf_config


def _spec(arch="qwen2", **kw) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_hf_config(arch, **kw))


def _labeled(rows: int, offset: float, cols: int = 3) -> torch.Tensor:
    """Row i holds offset + i in every column: the layout can be read back from the values."""
    return (offset + torch.arange(rows, dtype=torch.float32))[:, None].repeat(1, cols)


def test_fuse_qkv_groups_heads_by_hand():
    # 4 query heads, 2 groups, head_dim 2 (tiny spec with head_dim overridden).
    spec = _spec().replace(head_dim=2)
    q, k, v = _labeled(8, 100), _labeled(4, 200), _labeled(4, 300)
    fused = reshape.fuse_qkv([q, k, v], spec)
    # group 0: q heads 0,1 (rows 100..103), k_0 (200, 201), v_0 (300, 301); then group 1.
    expected = [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    assert fused[:, 0].tolist() == expected
    back = reshape.split_qkv(fused, spec)
    for got, want in zip(back, (q, k, v)):
        assert torch.equal(got, want)
    bias = reshape.fuse_qkv([q[:, 0], k[:, 0], v[:, 0]], spec)
    assert bias.tolist() == expected


def test_gate_up_tp_shards_by_hand():
    spec = _spec().replace(ffn_hidden_size=4)
    gate, up = _labeled(4, 10), _labeled(4, 20)
    full = reshape.fuse_gate_up([gate, up], spec)
    assert full[:, 0].tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    shards = [reshape.shard_tensor(full, "gate_up", r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [10, 11, 20, 21]
    assert shards[1][:, 0].tolist() == [12, 13, 22, 23]
    assert torch.equal(name_map.merge_tp_shards("decoder.layers.0.mlp.linear_fc1.weight", shards), full)


def test_row_and_column_shards():
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    row = [name_map.shard_for_tp("decoder.layers.3.self_attention.linear_proj.weight", full, r, 2)
           for r in range(2)]
    assert row[1].tolist() == [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]]
    col = [name_map.shard_for_tp("embedding.word_embeddings.weight", full, r, 2) for r in range(2)]
    assert col[1].tolist() == full[2:].tolist()
    assert torch.equal(name_map.merge_tp_shards("decoder.layers.3.self_attention.linear_proj.weight", row), full)


@pytest.mark.parametrize("name, dim", [
    ("embedding.word_embeddings.weight", 0), ("output_layer.weight", 0),
    ("decoder.layers.5.self_attention.linear_qkv.weight", 0),
    ("decoder.layers.5.self_attention.linear_qkv.bias", 0),
    ("decoder.layers.5.mlp.linear_fc1.weight", 0),
    ("decoder.layers.5.self_attention.linear_proj.weight", 1),
    ("decoder.layers.5.mlp.linear_fc2.weight", 1),
    ("decoder.layers.5.input_layernorm.weight", None),
    ("decoder.layers.5.self_attention.linear_qkv.layer_norm_weight", None),  # TE spelling
    ("decoder.layers.5.self_attention.q_layernorm.weight", None),
    ("decoder.final_layernorm.weight", None),
])
def test_partition_dim(name, dim):
    assert name_map.partition_dim(name) == dim


def test_unknown_megatron_name_is_named():
    with pytest.raises(ValueError, match="decoder.layers.0.mystery.weight"):
        name_map.partition_dim("decoder.layers.0.mystery.weight")


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True), ("qwen3", False),
                                        ("qwen3", True)])
def test_hf_names_are_the_transformers_state_dict(arch, tied):
    """Independent reference: the parameter names transformers itself saves."""
    model = make_tiny_hf_model(arch, None, tie_word_embeddings=tied)
    saved = set(model.state_dict())
    if tied:
        saved.discard("lm_head.weight")  # save_pretrained drops the tied duplicate
    assert set(name_map.hf_names(_spec(arch, tie_word_embeddings=tied))) == saved


def test_layer_translation_and_te_aliases():
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    assert name_map.to_global_layer_name(name, 2) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert name_map.to_local_layer_name("decoder.layers.3.mlp.linear_fc2.weight", 2) == name
    assert name_map.to_global_layer_name("output_layer.weight", 2) == "output_layer.weight"
    te = "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert name_map.canonical_name(te) == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert name_map.te_name("decoder.layers.0.pre_mlp_layernorm.weight") == te
    assert name_map.layer_number("decoder.layers.12.input_layernorm.weight") == 12


def test_megatron_to_hf_qkv_and_tied_output():
    spec = _spec("qwen2", tie_word_embeddings=True)
    d, ng, hpg = spec.head_dim, spec.num_query_groups, spec.heads_per_group
    full = torch.randn((spec.num_attention_heads + 2 * ng) * d, spec.hidden_size)
    out = dict(name_map.megatron_to_hf("decoder.layers.1.self_attention.linear_qkv.weight", full, spec))
    assert sorted(out) == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "kqv"]
    group1 = full.reshape(ng, (hpg + 2) * d, -1)[1]
    assert torch.equal(out["model.layers.1.self_attn.k_proj.weight"][d:], group1[hpg * d:(hpg + 1) * d])
    assert name_map.megatron_to_hf("output_layer.weight", torch.zeros(128, 64), spec) == []


def test_collector_round_trip_at_tp2():
    spec = _spec("qwen3", tie_word_embeddings=True)
    hf = {n: t for n, t in make_tiny_hf_model("qwen3", None, tie_word_embeddings=True).state_dict().items()}
    shards = [dict(name_map.hf_to_megatron_shards(hf.items(), spec, r, 2)) for r in range(2)]
    assert "output_layer.weight" in shards[0]  # tied: built from the embedding (last PP stage)
    for name in shards[0]:
        full = name_map.merge_tp_shards(name, [shards[0][name], shards[1][name]])
        for hf_name, tensor in name_map.megatron_to_hf(name, full, spec):
            assert torch.equal(tensor, hf[hf_name]), hf_name


def test_collector_errors_name_the_tensor():
    spec = _spec("qwen2")
    hf = dict(make_tiny_hf_model("qwen2", None).state_dict())
    missing = {n: t for n, t in hf.items() if n != "model.layers.1.self_attn.v_proj.bias"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias"):
        list(name_map.hf_to_megatron_shards(missing.items(), spec))
    bad = dict(hf, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 65)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(128, 65\)"):
        list(name_map.hf_to_megatron_shards(bad.items(), spec))
    extra = dict(hf, **{"model.layers.7.mlp.up_proj.weight": torch.zeros(128, 64)})
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.7"):
        list(name_map.hf_to_megatron_shards(extra.items(), spec))


def test_single_tensor_shard_and_stage_filter():
    spec = _spec("llama")
    down = torch.randn(64, 128)
    (name, shard), = name_map.hf_to_megatron_shard("model.layers.1.mlp.down_proj.weight", down, spec, 1, 2)
    assert name == "decoder.layers.1.mlp.linear_fc2.weight" and torch.equal(shard, down[:, 64:])
    wanted = name_map.megatron_names(spec, layers=[1], first_stage=False, last_stage=True)
    assert "embedding.word_embeddings.weight" not in wanted and "output_layer.weight" in wanted
    conv = name_map.HFToMegatron(spec, wanted=wanted)
    assert "model.layers.0.mlp.down_proj.weight" not in conv.sources()
    assert conv.add("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 128)) == []
