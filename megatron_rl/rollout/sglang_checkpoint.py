"""The checkpoint SGLang servers start from, and the rollout quantization that follows from it.

FP8 updates can only land in FP8 parameters: SGLang creates `weight` (float8_e4m3fn) and
`weight_scale_inv` [ceil(out/bn), ceil(in/bk)] per quantized linear only when it starts from a
serialized block-FP8 checkpoint (srt/layers/quantization/fp8.py, create_fp8_weight_). Started from
BF16 it has no scale parameters: Qwen3's load_weights then raises KeyError on the first
`q_proj.weight_scale_inv` (srt/models/qwen3.py:744) and Qwen2 / Llama drop it silently, serving
unscaled FP8 values. `--quantization fp8` on a BF16 checkpoint does not help: it quantizes online
per channel into `weight_scale`, not 128x128 blocks. So the servers load an FP8 checkpoint, made by
tools/convert_hf_to_fp8.py (the same quantizer as the weight sync), and the trainer quantizes
updates with that checkpoint's quantization_config, so the two can never disagree on block size or
scale format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from megatron_rl.fp8.rollout_quant import RolloutQuantSpec

log = logging.getLogger("megatron_rl.rollout.sglang")


def read_quantization_config(path: str | Path) -> dict:
    """config.json's quantization_config of an HF checkpoint ({} for an unquantized one)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(f"config key 'rollout.sglang.model_path': no HF checkpoint (config.json) in {path}")
    return json.loads(config.read_text()).get("quantization_config") or {}


def spec_from_checkpoint(path: str | Path, precision) -> RolloutQuantSpec:
    """The rollout quantization a server started from `path` holds; ValueError when the `precision`
    section says otherwise (naming both keys)."""
    qc = read_quantization_config(path)
    high = tuple(precision.high_precision)
    if not qc:
        if precision.rollout_quant != "bf16":
            raise ValueError(f"config key 'rollout.sglang.model_path': {path} is not quantized, but "
                             f"precision.rollout_quant={precision.rollout_quant!r}: the servers would have no "
                             "weight_scale_inv to load; give an FP8 checkpoint (tools/convert_hf_to_fp8.py)")
        return RolloutQuantSpec("bf16", tuple(precision.weight_block_size), precision.scale_format, high)
    if qc.get("quant_method") != "fp8" or not qc.get("weight_block_size"):
        raise ValueError(f"config key 'rollout.sglang.model_path': {path} has quantization_config {qc}; "
                         "only block-FP8 checkpoints (quant_method fp8 with weight_block_size) are supported")
    if precision.rollout_quant != "fp8_blockwise":
        raise ValueError(f"config key 'precision.rollout_quant': {precision.rollout_quant!r}, but "
                         f"rollout.sglang.model_path {path} is block-FP8; set precision.rollout_quant=fp8_blockwise")
    block = tuple(int(b) for b in qc["weight_block_size"])
    scale_format = "ue8m0" if qc.get("scale_fmt") == "ue8m0" else "fp32"
    return RolloutQuantSpec("fp8_blockwise", block, scale_format, high + tuple(qc.get("modules_to_not_convert") or ()))


def served_model_path(cfg) -> str:
    """The checkpoint the servers were given: MEGATRON_RL_MODEL for disaggregated servers (the serve
    step loads it first, cluster/launch.py serve_model), else rollout.sglang.model_path ("" = none)."""
    sg = cfg.rollout.sglang
    env = os.environ.get("MEGATRON_RL_MODEL", "") if sg.mode == "disaggregated" else ""
    return env or sg.model_path


def rollout_quant_spec(cfg) -> RolloutQuantSpec:
    """What the weight sync sends: from rollout.sglang.model_path when the servers load a given
    checkpoint, else from `precision` (an automatic conversion uses exactly those settings). For
    SGLang, unquantized tensors travel in BF16."""
    if cfg.rollout.engine != "sglang":
        return RolloutQuantSpec.from_config(cfg.precision)
    if cfg.precision.rollout_quant in ("nvfp4", "mxfp4"):
        raise ValueError(f"config key 'precision.rollout_quant': {cfg.precision.rollout_quant!r} (W4A4) is "
                         "emulated by the torch rollout engine only; SGLang takes bf16 or FP8")
    # The servers' quantization_config decides (a refused mismatch names both keys): updates in
    # another block size would load into the wrong scales.
    served = served_model_path(cfg)
    spec = spec_from_checkpoint(served, cfg.precision) if served else RolloutQuantSpec.from_config(cfg.precision)
    return dataclasses.replace(spec, unquantized_dtype="bfloat16")


def rollout_checkpoint(cfg, model_dir: Path) -> Path:
    """The folder the servers load: rollout.sglang.model_path, or `model_dir` converted to block-FP8
    into <log.dir>/rollout_fp8 when precision.rollout_quant is fp8_blockwise, or `model_dir`."""
    p = cfg.precision
    if served_model_path(cfg):  # disaggregated: never a conversion the servers do not load
        return Path(served_model_path(cfg))
    if p.rollout_quant != "fp8_blockwise":
        return Path(model_dir)
    out = Path(cfg.log.dir) / "rollout_fp8"
    if (out / "config.json").is_file() and read_quantization_config(out).get("weight_block_size") == list(p.weight_block_size):
        return out
    from megatron_rl.convert.hf_to_fp8 import convert_hf_to_fp8

    # Written to a temporary folder and renamed (atomic): a server never sees half a checkpoint.
    convert_hf_to_fp8(model_dir, out, block_size=tuple(p.weight_block_size), scale_format=p.scale_format,
                      high_precision=tuple(p.high_precision), overwrite=True, progress=False)
    log.info("SGLang servers load the block-FP8 checkpoint %s (converted from %s)", out, model_dir)
    return out


def deepgemm_scale_ue8m0(sm: int) -> bool:
    """Whether SGLang's DeepGEMM path re-quantizes FP32 block scales to UE8M0 on a GPU of compute
    capability `sm` (e.g. 90, 100): DEEPGEMM_SCALE_UE8M0 = JIT DeepGEMM (on by default) and sm100
    (layers/deep_gemm_wrapper/configurer.py:57-60); dense block-FP8 on sm120 stays FP32
    (model_loader/utils.py:266-290)."""
    return os.environ.get("SGLANG_ENABLE_JIT_DEEPGEMM", "1").lower() not in ("0", "false") and sm // 10 == 10


def check_scale_format(spec: RolloutQuantSpec, sm: int) -> None:
    """ValueError when the servers would re-quantize the weights the trainer sends: 128x128 FP32
    scales on a UE8M0 DeepGEMM GPU are rounded to powers of two at load (fp8_utils.py:2148-2181), so
    the served weights are not the ones the trainer's rollout-side quantization assumed."""
    if (spec.rollout_quant == "fp8_blockwise" and spec.scale_format != "ue8m0"
            and tuple(spec.weight_block_size) == (128, 128) and deepgemm_scale_ue8m0(sm)):
        raise ValueError(f"config key 'precision.scale_format': {spec.scale_format!r}, but SGLang on this GPU "
                         f"(sm{sm}, DeepGEMM) re-quantizes block scales to UE8M0 when it loads them; set "
                         "precision.scale_format=ue8m0 (or SGLANG_ENABLE_JIT_DEEPGEMM=0 on the servers)")


def check_block_alignment(model_dir: str | Path, spec: RolloutQuantSpec) -> None:
    """ValueError when SGLang would refuse the block-FP8 model at its first forward or at load:
    a quantized linear's input dim K not a multiple of the activation group (weight_block_size[1]):
    its per-token-group quantizer asserts K % group == 0 (kernels/ops/quantization/fp8_kernel.py:502);
    or a merged linear's output partition (qkv_proj: q, k, v; gate_up_proj) not a multiple of
    block_n: Fp8LinearMethod.validate_block_quant_shapes (layers/quantization/fp8.py:570-609) raises
    at load. The trainer's recipes and the embedded engine pad such partial blocks instead
    (SmolLM2-135M: hidden 576 = 4.5 blocks of 128, k/v 192 = 1.5)."""
    if spec.rollout_quant != "fp8_blockwise":
        return
    ragged = _ragged_dims(json.loads((Path(model_dir) / "config.json").read_text()), spec.weight_block_size)
    if ragged:
        fit = _fitting_block(model_dir)
        raise ValueError(f"config key 'precision.weight_block_size': {'; '.join(ragged)}: SGLang refuses "
                         f"{list(spec.weight_block_size)} for this model; a block that fits: [{fit}, {fit}] "
                         "(or rollout.engine=torch, which pads partial blocks)")


def _ragged_dims(config: dict, block: tuple[int, int]) -> list[str]:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config["num_attention_heads"]
    q, kv = heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim  # HF: kv heads default to heads
    group, block_n = block[1], block[0]
    inputs = {"hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"],
              "num_attention_heads * head_dim": q}
    outputs = {"q": q, "k": kv, "v": kv, "gate/up": config["intermediate_size"]}
    ragged_in = {k: v for k, v in inputs.items() if v % group}
    ragged_out = {k: v for k, v in outputs.items() if v % block_n}
    return ([f"activation groups of {group} do not divide the model's linear input dims {ragged_in}"] * bool(ragged_in)
            + [f"block_n = {block_n} does not divide the merged output partitions {ragged_out}"] * bool(ragged_out))


def _fitting_block(model_dir: str | Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    size = 128
    while size > 1 and _ragged_dims(config, (size, size)):
        size //= 2
    return size
