"""The NVFP4 export with nvidia-modelopt on CPU, on a tiny Qwen3: the layout SGLang 0.5.23's
modelopt_fp4 loader reads, and the values against the NVFP4 arithmetic computed independently
(megatron_rl/fp8/fp4.py, TE's reference) and activation amaxes recorded by hooks on the HF model."""

import json
import os
import shutil

import pytest
import torch
import transformers

if not os.environ.get("CI"):  # `make setup` installs the modelopt extra: in CI a skip is a failure
    pytest.importorskip("modelopt.torch.quantization")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron_rl.convert.hf_to_nvfp4 import check_nvfp4_layout, convert_hf_to_nvfp4  # noqa: E402
from megatron_rl.fp8.fp4 import e2m1_codes, nvfp4_quantize  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(root / "hf")
    (root / "hf" / "tokenizer_config.json").write_text("{}")  # a side file to carry over
    calib = [torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    amax = _input_amax(model, calib)
    summary = convert_hf_to_nvfp4(root / "hf", root / "out", calib)
    return root, model, amax, summary


def _input_amax(model, batches) -> dict:
    """max |input| of every Linear over the calibration batches, by forward hooks."""
    amax, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(mod, args, out, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for ids in batches:
            model(ids)
    for h in hooks:
        h.remove()
    return amax


def test_config_is_what_sglang_modelopt_fp4_reads(exported):
    root, _, _, summary = exported
    q = json.loads((root / "out" / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["quant_algo"]) == ("modelopt", "NVFP4")
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert set(q["ignore"]) == {"lm_head", "model.embed_tokens"}
    legacy = json.loads((root / "out" / "hf_quant_config.json").read_text())["quantization"]
    assert (legacy["quant_algo"], legacy["group_size"]) == ("NVFP4", 16)
    assert (root / "out" / "tokenizer_config.json").is_file()
    assert summary.details["quantized linears"] == 14


def test_layout_names_every_linear_of_every_layer(exported):
    root = exported[0]
    assert check_nvfp4_layout(root / "out") == sorted(
        f"model.layers.{i}.{lin}" for i in range(2) for lin in LINEARS)
    state = load_file(str(root / "out" / "model.safetensors"))
    assert state["model.layers.1.mlp.down_proj.weight"].shape == (64, 48)  # [out, in / 2]
    assert state["model.layers.1.mlp.down_proj.weight_scale"].shape == (64, 6)  # [out, in / 16]
    assert state["lm_head.weight"].dtype == torch.float32  # excluded: as it was


@pytest.mark.parametrize("layer", [f"model.layers.{i}.{lin}" for i in (0, 1) for lin in LINEARS])
def test_values_are_nvfp4_of_the_hf_weights(exported, layer):
    root, model, amax, _ = exported
    # Layers SGLang fuses into one GEMM (q|k|v, gate|up) share one global scale: the fused weight's.
    block, name = layer.rsplit(".", 1)
    group = next(g for g in FUSED if name in g)
    weights = [model.get_submodule(f"{block}.{n}").weight.detach() for n in group]
    rows = dict(zip(group, torch.tensor([0] + [w.shape[0] for w in weights]).cumsum(0).tolist()))
    fused = torch.cat(weights)
    weight = model.get_submodule(layer).weight.detach()
    with safe_open(str(root / "out" / "model.safetensors"), "pt") as f:
        packed, scale, scale_2, input_scale = (f.get_tensor(f"{layer}.{s}") for s in
                                               ("weight", "weight_scale", "weight_scale_2", "input_scale"))
    # global scale: amax / (6 * 448) of the (fused) weight, and of the calibrated input
    assert scale_2.item() == pytest.approx(fused.abs().max().item() / 2688, rel=1e-6)
    assert input_scale.item() == pytest.approx(amax[layer] / 2688, rel=1e-6)
    q, ref_scale, _ = nvfp4_quantize(fused)
    mine = slice(rows[name], rows[name] + weight.shape[0])
    q, ref_scale = q[mine], ref_scale[mine]
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(weight.shape)  # low nibble first
    assert torch.equal(codes, e2m1_codes(q))


def test_layout_check_names_what_sglang_would_not_load(exported, tmp_path):
    root = exported[0]
    bad = tmp_path / "bad"
    shutil.copytree(root / "out", bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight_scale"] = state["model.layers.0.mlp.up_proj.weight_scale"][:, :2].contiguous()
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight_scale has shape \[96, 2\], "
                                         r"SGLang loads \[96, 4\]"):
        check_nvfp4_layout(bad)
    del state["model.layers.0.mlp.up_proj.weight_scale"]
    del state["model.layers.1.self_attn.o_proj.input_scale"]
    state["model.layers.0.mlp.up_proj.weight_scale"] = torch.zeros(96, 4).to(torch.float8_e4m3fn)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.o_proj.input_scale is missing"):
        check_nvfp4_layout(bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["group_size"] = 32
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="group_size is 32, NVFP4 uses 16"):
        check_nvfp4_layout(bad)


def test_refusals_come_before_anything_is_written(exported, tmp_path):
    root = exported[0]
    with pytest.raises(ValueError, match="is already quantized"):
        convert_hf_to_nvfp4(root / "out", tmp_path / "x", [torch.zeros(1, 4, dtype=torch.long)])
    assert not (tmp_path / "x").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty"):
        convert_hf_to_nvfp4(root / "hf", tmp_path / "busy", [torch.zeros(1, 4, dtype=torch.long)])
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="calib_ids is empty"):
        convert_hf_to_nvfp4(root / "hf", tmp_path / "y", [])
    assert not (tmp_path / "y").exists()
