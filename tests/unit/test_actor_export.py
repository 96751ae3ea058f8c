"""Exporting the actor's weights to HF names reproduces the HF checkpoint exactly (TP=1)."""

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.actor.actor import MegatronActor


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True), ("qwen3", False),
                                        ("qwen3", True)])
def test_export_round_trip_is_exact(arch, tied, tiny_hf_factory, single_parallel):
    hf_dir = tiny_hf_factory(arch, tie_word_embeddings=tied)
    original = load_file(str(hf_dir / "model.safetensors"))
    actor = MegatronActor.build(hf_dir, parallel=single_parallel)
    exported = dict(actor.export_hf_weights())
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_exported_tensors_do_not_alias_parameters(qwen2_dir, single_parallel):
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel)
    exported = dict(actor.export_hf_weights())
    before = exported["model.norm.weight"].clone()
    for param in actor.model[0].parameters():
        param.data.add_(1.0)
    assert torch.equal(exported["model.norm.weight"], before)


def test_load_state_dict_from_memory(qwen2_dir, single_parallel):
    """load_hf_state_dict takes full HF tensors (e.g. from another process); dtype is converted."""
    original = load_file(str(qwen2_dir / "model.safetensors"))
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, load_weights=False)
    actor.load_hf_state_dict({n: t.to(torch.bfloat16) for n, t in original.items()})
    exported = dict(actor.export_hf_weights())
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(exported[name], original[name].to(torch.bfloat16).float())
