"""HF checkpoint -> the NVFP4 checkpoint SGLang serves on Blackwell (`--quantization modelopt_fp4`),
written by nvidia-modelopt's own quantize-and-export (the field's tool; runs on CPU).

modelopt is imported only here, inside functions (`pip install 'megatron_rl[modelopt]'`).
The layout SGLang 0.5.23 loads (srt/layers/quantization/modelopt_quant.py):
- config: ModelOptFp4Config.from_config reads config.json's quantization_config (flat:
  quant_algo "NVFP4", group_size, ignore) or hf_quant_config.json's "quantization" section
  (quant_algo, group_size, exclude_modules); quant_algo must be NVFP4 (1673-1678) and group_size
  and the excluded modules must be given (1682-1691).
- per quantized Linear X (ModelOptFp4LinearMethod.create_weights, 1807-1880): X.weight uint8
  [out, in / 2] (two E2M1 codes per byte along the input dim), X.weight_scale float8_e4m3fn
  [out, in / group_size], X.weight_scale_2 float32 scalar (the global scale), X.input_scale
  float32 scalar; in % 16 == 0 or it refuses (1822-1825).
check_nvfp4_layout reads a written folder against that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from megatron_rl.convert.output import Summary, atomic_output_dir, copy_side_files

NVFP4_GROUP = 16
# Files export_hf_checkpoint writes itself; the source's other side files (tokenizer) are copied.
_EXPORTED = ("config.json", "generation_config.json", "hf_quant_config.json")


def convert_hf_to_nvfp4(hf_dir: str | Path, out_dir: str | Path, calib_ids: Iterable[torch.Tensor],
                        *, overwrite: bool = False) -> Summary:
    """Quantize the HF model in `hf_dir` to NVFP4 with modelopt (weights and activations, 1x16
    blocks, activation scales calibrated on `calib_ids`: token id tensors [B, S] int64) and export
    it to `out_dir` (atomic). Returns the summary.

    Raises ValueError for a missing or already quantized checkpoint, a Linear whose input size is
    not a multiple of 16, a non-empty `out_dir` without `overwrite`, or modelopt not installed.
    """
    config = _read_config(hf_dir)
    if Path(out_dir).is_dir() and any(Path(out_dir).iterdir()) and not overwrite:
        raise ValueError(f"output folder {Path(out_dir).absolute()} exists and is not empty; "
                         f"pass --overwrite to replace it")  # before the model is loaded
    mtq, export_hf_checkpoint = _modelopt()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="auto").eval()
    _check_input_sizes(model)
    batches = list(calib_ids)
    if not batches:
        raise ValueError("calib_ids is empty: NVFP4 activation scales need calibration batches")

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(ids)

    summary = Summary("convert_hf_to_nvfp4", str(Path(out_dir).absolute()))
    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    with atomic_output_dir(out_dir, overwrite) as tmp:
        export_hf_checkpoint(model, export_dir=str(tmp))
        copied = copy_side_files(hf_dir, tmp, skip=_EXPORTED)
        layers = check_nvfp4_layout(tmp)
    summary.num_tensors = len(layers)
    summary.details.update({"architecture": ", ".join(config.get("architectures") or ["?"]),
                            "quantized linears": len(layers), "side files": ", ".join(copied) or "none"})
    return summary.finish()


def check_nvfp4_layout(folder: str | Path) -> list[str]:
    """Check a folder against SGLang 0.5.23's modelopt_fp4 loader (module docstring); returns the
    quantized layer prefixes. Raises ValueError naming the first tensor or key that differs."""
    from safetensors import safe_open

    quant = _quant_section(Path(folder))
    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            tensors.update({name: f.get_slice(name) for name in f.keys()})
    layers = sorted(n[: -len(".weight_scale_2")] for n in tensors if n.endswith(".weight_scale_2"))
    if not layers:
        raise ValueError(f"{folder}: no NVFP4 layer (no *.weight_scale_2 tensor)")
    for prefix in layers:
        _check_layer(prefix, tensors, quant["group_size"])
    return layers


def _check_layer(prefix: str, tensors: dict, group: int) -> None:
    want = {"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": "F32", "input_scale": "F32"}
    for suffix, dtype in want.items():
        name = f"{prefix}.{suffix}"
        if name not in tensors:
            raise ValueError(f"{name} is missing (SGLang's modelopt_fp4 loader needs it)")
        if tensors[name].get_dtype() != dtype:
            raise ValueError(f"{name} is {tensors[name].get_dtype()}, SGLang loads {dtype}")
    out, packed = tensors[f"{prefix}.weight"].get_shape()
    if (packed * 2) % NVFP4_GROUP:
        raise ValueError(f"{prefix}.weight: input size {packed * 2} is not a multiple of {NVFP4_GROUP}")
    if tensors[f"{prefix}.weight_scale"].get_shape() != [out, packed * 2 // group]:
        raise ValueError(f"{prefix}.weight_scale has shape {tensors[f'{prefix}.weight_scale'].get_shape()}, "
                         f"SGLang loads [{out}, {packed * 2 // group}]")
    for suffix in ("weight_scale_2", "input_scale"):
        if tensors[f"{prefix}.{suffix}"].get_shape() not in ([], [1]):
            raise ValueError(f"{prefix}.{suffix} is not a scalar")


def _quant_section(folder: Path) -> dict:
    """The quantization settings as ModelOptFp4Config.from_config reads them (config.json first)."""
    config = json.loads((folder / "config.json").read_text())
    flat = config.get("quantization_config") or {}
    if flat.get("quant_method") != "modelopt":
        raise ValueError(f"{folder}/config.json: quantization_config.quant_method is "
                         f"{flat.get('quant_method')!r}, SGLang's modelopt loaders need 'modelopt'")
    if flat.get("quant_algo") != "NVFP4":
        raise ValueError(f"{folder}/config.json: quant_algo is {flat.get('quant_algo')!r}, not 'NVFP4'")
    groups = {sub["group_size"] for g in flat.get("config_groups", {}).values()
              for sub in g.values() if isinstance(sub, dict) and "group_size" in sub}
    group = flat.get("group_size") or (groups.pop() if len(groups) == 1 else None)
    if group != NVFP4_GROUP:
        raise ValueError(f"{folder}/config.json: group_size is {group!r}, NVFP4 uses {NVFP4_GROUP}")
    if "ignore" not in flat:
        raise ValueError(f"{folder}/config.json: no 'ignore' list (SGLang needs the excluded modules)")
    return {"group_size": group, "ignore": flat["ignore"]}


def _check_input_sizes(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % NVFP4_GROUP and "lm_head" not in name:
            raise ValueError(f"{name}: in_features={module.in_features} is not a multiple of "
                             f"{NVFP4_GROUP} (NVFP4 blocks; SGLang refuses such a layer)")


def _read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"HF config not found: {path}")
    config = json.loads(path.read_text())
    if "quantization_config" in config:
        raise ValueError(f"{hf_dir} is already quantized: {config['quantization_config']}")
    return config


def _modelopt():
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    except ImportError as err:
        raise ValueError("the NVFP4 export needs nvidia-modelopt: pip install "
                         "'megatron_rl[modelopt]'") from err
    return mtq, export_hf_checkpoint
