"""The conversion tools around a training run: HF -> Megatron checkpoint -> train, then the
trainer's own checkpoint -> HF, loadable by transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from test_rl_loop import run_tiny  # noqa: E402

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(TOOLS / name), *args, "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_train_from_converted_checkpoint_and_export_back(tmp_path):
    # the reference run starts from the warm-started HF folder
    ref = run_tiny(tmp_path / "hf", "fp8_calibrated.yaml", "train.num_steps=2", "checkpoint.save_final=true")
    (hf_dir,) = [p for p in (tmp_path / "hf" / ".tiny_models").iterdir() if p.is_dir()]
    _tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--out-dir", str(tmp_path / "mcore"),
          "--tp", "2", "--pp", "2")
    # same run, weights taken from the converted torch_dist checkpoint: identical metrics
    conv = run_tiny(tmp_path / "hf2", "fp8_calibrated.yaml", "train.num_steps=2",
                    f"model.hf_dir={hf_dir}", f"model.megatron_ckpt={tmp_path / 'mcore'}")
    for key in ("reward/mean", "pg_loss", "grad_norm", "calib/low"):
        assert [r[key] for r in conv] == [r[key] for r in ref], key
    # the trainer's checkpoint (model + optimizer + RL state) converts back with no extra flags
    step_dir = tmp_path / "hf" / "run" / "checkpoints" / "step_000002"
    _tool("convert_megatron_to_hf.py", "--ckpt-dir", str(step_dir), "--out-dir", str(tmp_path / "out"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    exported, start = _hf_weights(tmp_path / "out"), _hf_weights(hf_dir)
    assert exported.keys() == start.keys()
    assert any(not torch.equal(exported[k], start[k]) for k in start)  # trained weights, not the start
    assert sum(p.numel() for p in model.parameters()) > 0
