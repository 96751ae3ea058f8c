"""Conversion tools: clear errors for bad input, atomic output, the CLIs' --help and exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.convert import torch_dist_io
from megatron_rl.convert.hf_to_fp8 import convert_hf_to_fp8
from megatron_rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_rl.convert.megatron_to_hf import convert_megatron_to_hf

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("convert_hf_to_megatron", "convert_megatron_to_hf", "convert_hf_to_fp8")


def copy_model(src: Path, dst: Path, edit=None) -> Path:
    """A copy of a tiny HF folder; `edit(tensors)` may change its single safetensors file."""
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_inputs(qwen2_dir, tmp_path):
    with pytest.raises(ValueError, match="config not found"):
        convert_hf_to_megatron(tmp_path / "nope", tmp_path / "out", progress=False)
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(qwen2_dir / "config.json", weightless)
    (weightless / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no \\*.safetensors weights.*pytorch_model.bin"):
        convert_hf_to_megatron(weightless, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="checkpoint folder not found"):
        convert_megatron_to_hf(tmp_path / "nope", tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="not a Megatron torch_dist checkpoint"):
        convert_megatron_to_hf(qwen2_dir, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="HF checkpoint folder not found"):
        convert_hf_to_fp8(tmp_path / "nope", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(qwen2_dir, tmp_path):
    gpt2 = copy_model(qwen2_dir, tmp_path / "gpt2")
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    for convert in (convert_hf_to_megatron, convert_hf_to_fp8):
        with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
            convert(gpt2, tmp_path / "out", progress=False)


def test_missing_unexpected_and_misshaped_tensors(qwen3_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    missing = copy_model(qwen3_dir, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing.*{name}"):
        convert_hf_to_megatron(missing, tmp_path / "out", progress=False)
    extra = copy_model(qwen3_dir, tmp_path / "extra",
                       lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected.*model.layers.7.mlp.up_proj.weight"):
        convert_hf_to_megatron(extra, tmp_path / "out", progress=False)
    misshaped = copy_model(qwen3_dir, tmp_path / "misshaped",
                           lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(ValueError, match=f"{name}' has shape \\(63, 64\\).*implies \\(64, 64\\)"):
        convert_hf_to_megatron(misshaped, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_tp_megatron_cannot_take(tiny_hf_factory, tmp_path):
    one_kv = tiny_hf_factory("qwen3", num_key_value_heads=1, num_hidden_layers=4)
    with pytest.raises(ValueError, match="tp=2, pp=1 do not fit.*num_key_value_heads=1"):
        convert_hf_to_megatron(one_kv, tmp_path / "out", tp=2, progress=False)
    with pytest.raises(ValueError, match="num_layers=4 is not divisible by pipeline_model_parallel_size=3"):
        convert_hf_to_megatron(one_kv, tmp_path / "out", pp=3, progress=False)


def test_checkpoint_config_mismatch_names_the_key(qwen2_dir, llama_dir, tmp_path):
    convert_hf_to_megatron(qwen2_dir, tmp_path / "mcore", progress=False)
    convert_hf_to_megatron(llama_dir, tmp_path / "llama", progress=False)
    with pytest.raises(ValueError, match="does not describe.*linear_qkv.bias.*wrong --hf-config-dir"):
        convert_megatron_to_hf(tmp_path / "mcore", tmp_path / "out", hf_config_dir=llama_dir,
                               progress=False)
    with pytest.raises(ValueError, match="no 'decoder.layers.self_attention.linear_qkv.bias'"):
        convert_megatron_to_hf(tmp_path / "llama", tmp_path / "out", hf_config_dir=qwen2_dir,
                               progress=False)
    wide = copy_model(qwen2_dir, tmp_path / "wide")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    with pytest.raises(ValueError, match="'decoder.layers.mlp.linear_fc1.weight' has shape "
                                         "\\(2, 256, 64\\).*implies \\(2, 512, 64\\)"):
        convert_megatron_to_hf(tmp_path / "mcore", tmp_path / "out", hf_config_dir=wide, progress=False)


def test_trainer_checkpoint_without_config(qwen2_dir, tmp_path):
    step = tmp_path / "step_000001" / "model"
    convert_hf_to_megatron(qwen2_dir, step, progress=False)
    shutil.rmtree(step / "hf")
    (step / "common.pt").unlink()  # what a checkpoint not written by this package lacks
    with pytest.raises(ValueError, match="pass --hf-config-dir"):
        convert_megatron_to_hf(step.parent, tmp_path / "out", progress=False)


def test_existing_output_needs_overwrite(qwen2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ValueError, match="exists and is not empty; pass --overwrite"):
        convert_hf_to_fp8(qwen2_dir, out, progress=False)
    assert (out / "keep.txt").read_text() == "old"
    convert_hf_to_fp8(qwen2_dir, out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_failure_leaves_no_complete_looking_folder(qwen2_dir, tmp_path, monkeypatch):
    """A crash mid-write leaves the old folder (or none) and no partial folder behind."""
    def crash_after_first_chunk(items, resolve):
        calls = []

        def failing(item):
            calls.append(item)
            if len(calls) > 3:
                raise RuntimeError("disk full")
            return resolve(item)

        return real_planner(items, failing)

    real_planner = torch_dist_io._LazySavePlanner
    monkeypatch.setattr(torch_dist_io, "_LazySavePlanner", crash_after_first_chunk)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_hf_to_megatron(qwen2_dir, tmp_path / "new", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metadata.json").write_text("{}")
    with pytest.raises(RuntimeError, match="disk full"):
        convert_hf_to_megatron(qwen2_dir, tmp_path / "old", overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert (tmp_path / "old" / "metadata.json").read_text() == "{}"


@pytest.mark.parametrize("tool", TOOLS)
def test_cli_help_has_examples(tool):
    done = subprocess.run([sys.executable, str(REPO / "tools" / f"{tool}.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "examples:" in done.stdout and f"tools/{tool}.py --" in done.stdout


def test_cli_errors_and_summary(qwen2_dir, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import convert_hf_to_megatron as tool
    finally:
        sys.path.pop(0)
    assert tool.main(["--hf-dir", str(tmp_path / "nope"), "--out-dir", str(tmp_path / "o")]) == 2
    assert "convert_hf_to_megatron: error: HF config not found" in capsys.readouterr().err
    assert tool.main(["--hf-dir", str(qwen2_dir), "--out-dir", str(tmp_path / "o"), "--tp", "2",
                      "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "convert_hf_to_megatron: done" in out and "peak RSS" in out and "2 x 1" in out
