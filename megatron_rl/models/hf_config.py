"""HF config.json -> ModelSpec -> Megatron-Core TransformerConfig / GPTModel arguments."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# HF model_type -> our family name. Qwen2.5 checkpoints declare model_type "qwen2".
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the actor, the name map and the converters need to know about one dense model."""

    arch: str
    """Family: "llama" (Llama 3.x), "qwen2" (Qwen2 / Qwen2.5) or "qwen3" (Qwen3 dense)."""
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (grouped-query attention); equals num_attention_heads for plain MHA."""
    head_dim: int
    """Per-head channels (Megatron kv_channels). Qwen3 sets it independently of hidden_size."""
    norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_type: str = "default"
    """"default" | "linear" | "llama3" (HF rope_parameters["rope_type"])."""
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on q/k/v projections only (Qwen2); the output projection never has one here."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def hf_architecture(self) -> str:
        return HF_ARCHITECTURES[self.arch]

    @classmethod
    def from_hf_config(cls, hf_config_or_dir: Any) -> "ModelSpec":
        """Reads a HF config: a folder holding config.json, the json path, a dict or a PretrainedConfig.

        Raises ValueError naming the key for an unsupported architecture or setting.
        """
        cfg = _config_dict(hf_config_or_dir)
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type={model_type!r} is not supported; "
                             f"supported: {sorted(FAMILIES)}")
        arch = FAMILIES[model_type]
        _check_supported(cfg, arch)
        heads = int(cfg["num_attention_heads"])
        spec = cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            norm_eps=float(cfg["rms_norm_eps"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            **_rope_fields(cfg),
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        """Raises ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                     "num_attention_heads", "num_query_groups", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_query_groups}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.arch not in HF_ARCHITECTURES:
            raise ValueError(f"arch={self.arch!r} is not supported")

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def _config_dict(src: Any) -> dict:
    if isinstance(src, dict):
        return dict(src)
    if isinstance(src, (str, Path)):
        path = Path(src)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"HF config not found: {path}")
        return json.loads(path.read_text())
    if hasattr(src, "to_dict"):
        return src.to_dict()
    raise ValueError(f"cannot read a HF config from {type(src).__name__}")


def _check_supported(cfg: dict, arch: str) -> None:
    """Settings the dense Megatron mapping does not reproduce: refuse rather than diverge silently."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU needs 'silu')")
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported")
    if arch != "qwen2" and cfg.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported (bias on o_proj)")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={cfg['partial_rotary_factor']} is not supported")


def _rope_fields(cfg: dict) -> dict:
    """Reads both layouts: transformers 5 `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {ROPE_TYPES}")
    fields = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        fields["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = float(params["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(params["high_freq_factor"])
        fields["rope_original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    return fields


def check_divisibility(spec: ModelSpec, tp: int, pp: int) -> None:
    """ValueError unless the model splits evenly: layers over PP stages; attention heads, KV heads,
    vocabulary and FFN width over TP ranks. The actor (transformer_config_kwargs) and the planner
    (`megatron-rl plan`) both call it, so they refuse with the same message."""
    if spec.num_layers % pp:
        raise ValueError(f"num_layers={spec.num_layers} is not divisible by "
                         f"pipeline_model_parallel_size={pp}")
    if spec.num_query_groups % tp:
        raise ValueError(f"num_key_value_heads={spec.num_query_groups} is not divisible by "
                         f"tensor_model_parallel_size={tp}")
    if spec.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={spec.num_attention_heads} is not divisible by "
                         f"tensor_model_parallel_size={tp}")
    if spec.vocab_size % tp:
        raise ValueError(f"vocab_size={spec.vocab_size} is not divisible by "
                         f"tensor_model_parallel_size={tp} (vocab padding is not supported)")
    if spec.ffn_hidden_size % tp:
        raise ValueError(f"intermediate_size={spec.ffn_hidden_size} is not divisible by "
                         f"tensor_model_parallel_size={tp}")


def transformer_config_kwargs(spec: ModelSpec, *, tp: int = 1, pp: int = 1,
                              params_dtype: torch.dtype = torch.float32) -> dict:
    """Keyword arguments for megatron.core TransformerConfig reproducing the HF model.

    The fusion flags are off because their kernels are CUDA-only (ecosystem.md lists them as the
    CPU-safe set); on GPUs the TE layer spec fuses on its own.
    """
    check_divisibility(spec, tp, pp)
    return dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        layernorm_epsilon=spec.norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,  # our RoPE frequencies are per token ([S, B, 1, D]); see models/rope.py
        persist_layer_norm=False,
    )


def gpt_model_kwargs(spec: ModelSpec) -> dict:
    """Keyword arguments for megatron.core GPTModel (RoPE settings are GPTModel arguments).

    The GPTModel's own RotaryEmbedding stays unused: the actor computes RoPE from per-token
    positions with the HF frequencies (models/rope.py), so llama3 scaling needs no patching.
    """
    return dict(
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        parallel_output=True,
    )
