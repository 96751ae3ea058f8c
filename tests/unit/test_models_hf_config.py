"""ModelSpec from HF configs, Megatron kwargs, RoPE frequencies against hand values and HF's module."""

import json
import math

import pytest
import torch

from megatron_rl.models.hf_config import ModelSpec, gpt_model_kwargs, transformer_config_kwargs
from megatron_rl.models.rope import rope_angles, rope_inv_freq
from megatron_rl.models.tiny import tiny_hf_config


def test_spec_from_each_tiny_config():
    llama = ModelSpec.from_hf_config(tiny_hf_config("llama"))
    assert (llama.arch, llama.vocab_size, llama.hidden_size, llama.ffn_hidden_size) == ("llama", 128, 64, 128)
    assert (llama.num_layers, llama.num_attention_heads, llama.num_query_groups) == (2, 4, 2)
    assert llama.head_dim == 16 and llama.heads_per_group == 2
    assert (llama.qkv_bias, llama.qk_norm, llama.tie_word_embeddings) == (False, False, False)
    assert llama.rope_type == "llama3" and llama.rope_factor == 8.0
    assert llama.rope_original_max_position_embeddings == 64 and llama.rope_theta == 500000.0
    qwen2 = ModelSpec.from_hf_config(tiny_hf_config("qwen2", tie_word_embeddings=True))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.tie_word_embeddings
    assert qwen2.rope_type == "default" and qwen2.rope_theta == 1e6
    qwen3 = ModelSpec.from_hf_config(tiny_hf_config("qwen3"))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    assert qwen3.hf_architecture == "Qwen3ForCausalLM"


def test_spec_from_folder_and_legacy_rope_keys(tmp_path):
    """Older config.json files carry rope_theta / rope_scaling at top level."""
    cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 1234.0,
           "rope_scaling": {"type": "linear", "factor": 2.0}, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(tmp_path)
    assert spec.rope_theta == 1234.0 and spec.rope_type == "linear" and spec.rope_factor == 2.0
    assert spec.head_dim == 8 and spec.num_query_groups == 4 and spec.norm_eps == 1e-5


@pytest.mark.parametrize("change, key", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_config_names_the_key(change, key):
    cfg = tiny_hf_config("qwen3").to_dict()
    cfg.update(change)
    with pytest.raises(ValueError, match=key):
        ModelSpec.from_hf_config(cfg)


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        ModelSpec.from_hf_config(tmp_path / "nowhere")


@pytest.mark.parametrize("tp, pp, key", [(4, 1, "num_key_value_heads"), (1, 3, "num_layers"),
                                          (3, 1, "num_key_value_heads")])
def test_parallel_sizes_that_do_not_divide(tp, pp, key):
    spec = ModelSpec.from_hf_config(tiny_hf_config("qwen2"))
    with pytest.raises(ValueError, match=key):
        transformer_config_kwargs(spec, tp=tp, pp=pp)


def test_megatron_kwargs():
    spec = ModelSpec.from_hf_config(tiny_hf_config("qwen3", tie_word_embeddings=True))
    kw = transformer_config_kwargs(spec, tp=2, pp=1)
    assert kw["kv_channels"] == 32 and kw["num_query_groups"] == 2 and kw["qk_layernorm"]
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and not kw["add_bias_linear"]
    assert kw["layernorm_epsilon"] == 1e-6 and kw["tensor_model_parallel_size"] == 2
    gk = gpt_model_kwargs(spec)
    assert gk["share_embeddings_and_output_weights"] and gk["position_embedding_type"] == "rope"
    assert gk["vocab_size"] == 128 and gk["rotary_base"] == 1e6


def test_default_inv_freq_by_hand():
    spec = ModelSpec.from_hf_config(tiny_hf_config("qwen2"))  # head_dim 16, theta 1e6
    expected = torch.tensor([1.0 / (1e6 ** (2 * i / 16)) for i in range(8)], dtype=torch.float32)
    torch.testing.assert_close(rope_inv_freq(spec), expected, rtol=1e-6, atol=0)


def test_llama3_inv_freq_matches_transformers():
    """Independent reference: the HF rotary module with the same config."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_hf_config("llama")
    spec = ModelSpec.from_hf_config(config)
    ref = LlamaRotaryEmbedding(config).inv_freq
    torch.testing.assert_close(rope_inv_freq(spec), ref, rtol=0, atol=0)
    # The low-frequency end is divided by the factor (8): wavelength > 64 / low_freq_factor.
    base = 1.0 / (500000.0 ** (14 / 16))
    assert 2 * math.pi / base > 64
    assert rope_inv_freq(spec)[-1].item() == pytest.approx(base / 8.0, rel=1e-6)


def test_rope_angles_layout():
    inv_freq = torch.tensor([1.0, 0.5])
    pos = torch.tensor([[0, 1, 2], [0, 1, 0]])
    angles = rope_angles(inv_freq, pos)
    assert angles.shape == (3, 2, 1, 4)
    assert angles[2, 0, 0].tolist() == [2.0, 1.0, 2.0, 1.0]
    assert angles[2, 1, 0].tolist() == [0.0, 0.0, 0.0, 0.0]
    same = rope_angles(inv_freq, torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert same.shape == (3, 1, 1, 4)  # identical rows broadcast over the batch
