"""Converted checkpoints in real TP=2 and PP=2 actors (2 gloo processes), and back from their saves.

The parent converts each tiny HF model once with --tp 2 --pp 2 (one process, no Megatron). Each
layout then loads it into a randomly initialized actor (model weights only, strict), computes
log-probs and saves the trainer's checkpoint (model + optimizer) with Megatron's own save.
Expected values: the HF model's own log-probs, the original HF tensors, and the chunk layout
Megatron-Core writes itself at TP=2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _launch import run_distributed
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from megatron_rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_rl.convert.megatron_to_hf import convert_megatron_to_hf

MODELS = {"llama": ("llama", {}), "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
          "qwen3": ("qwen3", {})}
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
B, S = 2, 10


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(11))


def load_model_only(actor, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    from megatron_rl.actor.forward import unwrap_model

    model = unwrap_model(actor.model[0])
    state = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="")}, ckpt_dir,
                                    strict="raise_all")
    model.load_state_dict(state["model"])


def worker(rank: int, world_size: int, paths: dict) -> dict:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.parallel import init_parallel

    import multiprocessing

    # Megatron's dist_checkpointing.save forks writer processes, which a daemonic process may not
    # do; _launch starts its workers as daemons. This worker joins its own forks before returning.
    multiprocessing.current_process().daemon = False
    results = {}
    for layout, (tp, pp) in LAYOUTS.items():
        parallel = init_parallel(tp, pp, seed=0)
        for model in MODELS:
            actor = MegatronActor.build(paths[model]["hf"], parallel=parallel, load_weights=False, seed=99)
            load_model_only(actor, paths[model]["converted"])
            batch = {"tokens": tokens(), "loss_mask": torch.ones(B, S)}
            out = actor.compute_logprobs(batch, micro_batch_size=1, with_entropy=False)
            actor.save_checkpoint(paths[model][f"trainer_{layout}"])
            results[f"{layout}/{model}"] = out["logprobs"]
    return results


def hf_logprobs(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = tokens()
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def chunk_layout(ckpt_dir: Path) -> dict:
    metadata = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    return {key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            for key, md in metadata.items() if hasattr(md, "chunks")}


@pytest.fixture(scope="module")
def paths(tiny_hf_factory, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("convert_dist")
    out = {}
    for model, (arch, overrides) in MODELS.items():
        hf_dir = tiny_hf_factory(arch, num_hidden_layers=4, **overrides)
        entry = {"hf": str(hf_dir), "converted": str(root / model / "converted")}
        convert_hf_to_megatron(hf_dir, entry["converted"], tp=2, pp=2, progress=False)
        for layout in LAYOUTS:
            folder = root / model / f"trainer_{layout}"
            folder.mkdir(parents=True)
            entry[f"trainer_{layout}"] = str(folder)
        out[model] = entry
    return out


@pytest.fixture(scope="module")
def results(paths) -> list[dict]:
    return run_distributed(worker, world_size=2, args=(paths,), timeout_s=180)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_converted_checkpoint_gives_hf_logprobs(results, paths, layout, model):
    expected = hf_logprobs(Path(paths[model]["hf"]))
    for rank_result in results:  # every rank returns the full log-probs
        torch.testing.assert_close(rank_result[f"{layout}/{model}"][:, 1:], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_trainer_checkpoint_back_to_hf_is_bitwise(results, paths, layout, model, tmp_path):
    convert_megatron_to_hf(paths[model][f"trainer_{layout}"], tmp_path / "hf",
                           hf_config_dir=paths[model]["hf"], progress=False)
    original, back = hf_tensors(Path(paths[model]["hf"])), hf_tensors(tmp_path / "hf")
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tp2_chunks_match_megatron(results, paths, model):
    """--tp 2 writes the model chunks Megatron's own TP=2 save writes (PP does not change them)."""
    ours = chunk_layout(Path(paths[model]["converted"]))
    tp2 = chunk_layout(Path(paths[model]["trainer_tp2"]))
    assert ours == {key: tp2[key] for key in ours}  # the trainer's save adds optimizer keys
    pp2 = chunk_layout(Path(paths[model]["trainer_pp2"]))
    assert ours != {key: pp2[key] for key in ours}  # TP=1 chunks differ
