"""HF -> FP8 blockwise checkpoint: layout SGLang loads, untouched high-precision tensors, FP8 error.

The dequantization and the error bound are written out here (block broadcast by hand, E4M3's
half-ulp bound), not taken from the quantizer under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_rl.convert.hf_to_fp8 import convert_hf_to_fp8

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# hidden 160 / ffn 320 / head_dim 32: none a multiple of 128, so edge blocks are partial.
SHAPES = dict(hidden_size=160, intermediate_size=320, num_hidden_layers=2)


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def dequantize_by_hand(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape
    scales = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.to(torch.float32) * scales


@pytest.fixture(scope="module")
def bf16_qwen3(tmp_path_factory) -> Path:
    from megatron_rl.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("qwen3_bf16")
    make_tiny_hf_model("qwen3", out, dtype=torch.bfloat16, **SHAPES)
    (out / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    return out


@pytest.mark.parametrize("scale_format,block", [("fp32", (128, 128)), ("ue8m0", (128, 128)),
                                                ("fp32", (64, 32))])
def test_fp8_checkpoint(bf16_qwen3, tmp_path, scale_format, block):
    summary = convert_hf_to_fp8(bf16_qwen3, tmp_path / "fp8", block_size=block,
                                scale_format=scale_format, max_shard_bytes=50_000, progress=False)
    original, out = read_all(bf16_qwen3), read_all(tmp_path / "fp8")
    quantized = [n for n in original if n.endswith(".weight") and any(p in n for p in LINEAR)]
    assert len(quantized) == 7 * SHAPES["num_hidden_layers"] == summary.details["quantized"]
    assert sorted(out) == sorted(list(original) + [n + "_scale_inv" for n in quantized])
    for name, tensor in original.items():
        if name not in quantized:  # embeddings, norms, lm_head: byte for byte
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], tensor), name
            continue
        q, scale_inv = out[name], out[name + "_scale_inv"]
        rows, cols = tensor.shape
        assert q.dtype == torch.float8_e4m3fn and q.shape == tensor.shape
        assert scale_inv.dtype == torch.float32
        assert scale_inv.shape == (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        x = tensor.float()
        deq = dequantize_by_hand(q, scale_inv, block)
        scales = dequantize_by_hand(torch.ones_like(q), scale_inv, block)
        # E4M3: 3 mantissa bits -> relative half-ulp 2^-4; below 2^-6 the step is 2^-9 (half 2^-10).
        bound = x.abs() * 2.0**-4 + scales * 2.0**-10
        assert bool(((deq - x).abs() <= bound).all()), name
        if scale_format == "ue8m0":
            exponent = torch.log2(scale_inv)
            assert torch.equal(exponent, exponent.round()), name
        # Every block uses E4M3's range: its largest code lies in the top binade [224, 448].
        codes = q.float().abs()
        for i in range(0, rows, block[0]):
            for j in range(0, cols, block[1]):
                assert 224.0 <= float(codes[i:i + block[0], j:j + block[1]].max()) <= 448.0, name


def test_config_and_files(bf16_qwen3, tmp_path):
    convert_hf_to_fp8(bf16_qwen3, tmp_path / "fp8", scale_format="ue8m0", progress=False)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    original = json.loads((bf16_qwen3 / "config.json").read_text())
    assert config.pop("quantization_config") == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "modules_to_not_convert": ["lm_head"]}
    assert config == original
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_all(tmp_path / "fp8"))
    assert all((tmp_path / "fp8" / f).is_file() for f in set(index["weight_map"].values()))
    assert (tmp_path / "fp8" / "tokenizer_config.json").read_text() == '{"model_max_length": 256}\n'


def test_dequantized_model_matches_within_fp8_error(bf16_qwen3, tmp_path):
    """A model rebuilt from the dequantized weights predicts like the original (FP8 weights only)."""
    from transformers import AutoModelForCausalLM

    convert_hf_to_fp8(bf16_qwen3, tmp_path / "fp8", progress=False)
    out = read_all(tmp_path / "fp8")
    weights = {n: dequantize_by_hand(t, out[n + "_scale_inv"], (128, 128)) if n + "_scale_inv" in out
               else t.float() for n, t in out.items() if not n.endswith("_scale_inv")}
    reference = AutoModelForCausalLM.from_pretrained(bf16_qwen3, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(bf16_qwen3, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp_ref = torch.log_softmax(reference(tokens).logits, -1)
        logp_fp8 = torch.log_softmax(model(tokens).logits, -1)
    kl = float((logp_ref.exp() * (logp_ref - logp_fp8)).sum(-1).mean())
    # Measured 0.008 on this random model; scales applied to the wrong blocks give 0.25, scales
    # off by 2x give 0.19: the bound separates FP8 rounding from a layout or scale bug.
    assert 0.0 < kl < 0.05


def test_refuses_quantized_input_and_bad_options(bf16_qwen3, tmp_path):
    convert_hf_to_fp8(bf16_qwen3, tmp_path / "fp8", progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        convert_hf_to_fp8(tmp_path / "fp8", tmp_path / "again", progress=False)
    with pytest.raises(ValueError, match="scale_format"):
        convert_hf_to_fp8(bf16_qwen3, tmp_path / "x", scale_format="e8m0", progress=False)
    with pytest.raises(ValueError, match="block_size"):
        convert_hf_to_fp8(bf16_qwen3, tmp_path / "x", block_size=(0, 128), progress=False)
    assert not (tmp_path / "x").exists()
