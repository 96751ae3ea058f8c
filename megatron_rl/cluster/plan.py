"""`megatron-rl plan`: the per-GPU plan as a table or JSON, and the start-of-training check."""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.models.hf_config import ModelSpec, check_divisibility
from megatron_rl.cluster.memory import GB, Cluster, kv_tokens, rollout_memory, trainer_memory


def is_colocated(cfg: RunConfig) -> bool:
    """The embedded engine always shares the trainer's device; SGLang when mode is colocated."""
    return cfg.rollout.engine == "torch" or cfg.rollout.sglang.mode == "colocated"


def trainer_dp(cfg: RunConfig, cluster: Cluster) -> int:
    par = cfg.parallel
    model_parallel = (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                      * par.context_parallel_size)
    rollout_nodes = 0 if is_colocated(cfg) else (
        cluster.nodes // 2 if cluster.rollout_nodes is None else cluster.rollout_nodes)
    gpus = (cluster.nodes - rollout_nodes) * cluster.gpus_per_node
    if gpus < model_parallel or gpus % model_parallel:
        raise ValueError(f"config key 'parallel': {gpus} trainer GPUs are not a multiple of "
                         f"TP x PP x CP = {model_parallel}")
    return gpus // model_parallel


def plan(cfg: RunConfig, spec: ModelSpec, cluster: Cluster, cuda: bool = True) -> dict:
    """The plan as `megatron-rl plan --json` prints it (GB per GPU). ValueError, as the actor would
    raise it, when the model does not split over the configured TP / PP sizes."""
    check_divisibility(spec, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size)
    trainer = trainer_memory(cfg, spec, trainer_dp(cfg, cluster), cuda)
    colocated = is_colocated(cfg)
    # Colocated servers start after the trainer is built (loop/build.py): its state is resident then.
    trainer_state = sum(trainer[k] for k in ("weights", "grads", "optimizer", "cuda_context"))
    resident = trainer_state if colocated and cfg.rollout.engine == "sglang" else 0.0
    rollout = rollout_memory(cfg, spec, cluster.gpu_mem_gb, resident)
    t_total, r_total = sum(trainer.values()), sum(rollout.values())
    if colocated:
        # The protocol (loop/colocated.py) never holds both: while training the released engine
        # keeps its CUDA graphs (outside torch_memory_saver unless SGLANG_MEMORY_SAVER_CUDA_GRAPH)
        # and its process context; while generating the offloaded trainer keeps its context and
        # TE's FP8 weight caches (module attributes, not parameters: offload does not move them).
        # A checkpoint save between steps (loop/colocated.py trainer_on_device): the engine keeps
        # its weights, graphs and context, the trainer is back without activations.
        phases = {"training": t_total + rollout["cuda_graphs"] + rollout["cuda_context"],
                  "generating": r_total + trainer["cuda_context"] + trainer["fp8_weight_cache"],
                  # whatever the engine: the trainer's state is back beside the engine's weights
                  "saving": trainer_state + rollout["weights"] + rollout["cuda_graphs"] + rollout["cuda_context"]}
    else:  # each side on its own GPUs
        phases = {"training": t_total, "generating": r_total}
    peak_phase = max(phases, key=phases.__getitem__)
    peak = phases[peak_phase]
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    tokens = kv_tokens(cfg, spec, rollout["kv_cache"])
    return {"trainer": _gb({**trainer, "total": t_total}), "rollout": _gb({**rollout, "total": r_total}),
            "colocated": colocated, "phases": _gb(phases), "peak_phase": peak_phase,
            "peak_gb_per_gpu": round(peak / GB, 2), "gpu_mem_gb": cluster.gpu_mem_gb,
            "kv_cache_tokens": tokens, "sequence_tokens": longest,
            "fits": peak <= cluster.gpu_mem_gb * GB and tokens >= longest}


def _gb(parts: dict[str, float]) -> dict[str, float]:
    return {k: round(v / GB, 2) for k, v in parts.items()}


def format_table(result: dict) -> str:
    lines = [f"{'part':<26}{'GB/GPU':>8}"]
    for side in ("trainer", "rollout"):
        for part, value in result[side].items():
            lines.append(f"{side + '.' + part:<26}{value:>8.2f}")
    where = "colocated (one GPU, release/offload protocol)" if result["colocated"] else "disaggregated"
    phases = ", ".join(f"{name} {value:.2f}" for name, value in result["phases"].items())
    lines += [f"layout: {where}; GB/GPU by phase: {phases}",
              f"KV cache holds {result['kv_cache_tokens']} tokens; the longest sequence needs "
              f"{result['sequence_tokens']}",
              f"peak {result['peak_gb_per_gpu']:.2f} GB of {result['gpu_mem_gb']:.0f} GB per GPU "
              f"({result['peak_phase']}): " + ("fits" if result["fits"] else "DOES NOT FIT")]
    return "\n".join(lines)


def spec_of(cfg: RunConfig, hf_config: str | Path | None = None) -> ModelSpec:
    """The model from its config.json only (`hf_config`, else model.hf_dir or model.gguf's
    conversion, else the tiny model)."""
    if hf_config is not None:
        return ModelSpec.from_hf_config(hf_config)
    if cfg.model.gguf:
        from megatron_rl.convert.gguf_to_hf import cached_hf_dir

        return ModelSpec.from_hf_config(cached_hf_dir(cfg.model.gguf) / "config.json")
    if cfg.model.hf_dir:
        path = Path(cfg.model.hf_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"config key 'model.hf_dir': no config.json in {cfg.model.hf_dir} "
                             "(pass --hf-config PATH to plan without the checkpoint)")
        return ModelSpec.from_hf_config(path)
    from megatron_rl.data.char_tokenizer import build_char_tokenizer
    from megatron_rl.models.tiny import tiny_hf_config, tiny_model_kwargs

    kwargs = tiny_model_kwargs(cfg.model, build_char_tokenizer())
    return ModelSpec.from_hf_config(tiny_hf_config(cfg.model.tiny_arch, **kwargs).to_dict())


def job_cluster() -> Cluster | None:
    """This job's GPUs (WORLD_SIZE, LOCAL_WORLD_SIZE, the device's memory); disaggregated rollout
    nodes are outside the job. None without CUDA: there is no device memory to plan."""
    import torch

    if not torch.cuda.is_available():
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(int(os.environ.get("WORLD_SIZE", "1")) // per_node, 1)
    gpu_gb = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GB
    return Cluster(nodes, per_node, gpu_gb, rollout_nodes=0)


def check_fits(cfg: RunConfig, cluster: Cluster | None) -> dict | None:
    """At the start of `megatron-rl train`: refuse a config the plan says cannot fit on `cluster`
    (job_cluster(); None: nothing to check). train.allow_oversized=true goes on anyway."""
    if cluster is None:
        return None
    result = plan(cfg, spec_of(cfg), cluster)
    if not result["fits"] and not cfg.train.allow_oversized:
        raise ValueError("the memory plan says this config does not fit (set "
                         "train.allow_oversized=true to start anyway):\n" + format_table(result))
    return result


def main(args) -> int:
    """`megatron-rl plan` (args from cli.py): exit 0 when it fits, 1 when it does not."""
    from megatron_rl.config import load_config

    cfg = load_config(args.config, args.overrides)
    cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_mem_gb, args.rollout_nodes)
    result = plan(cfg, spec_of(cfg, args.hf_config), cluster)
    print(json.dumps(result) if args.json else format_table(result))
    return 0 if result["fits"] else 1
