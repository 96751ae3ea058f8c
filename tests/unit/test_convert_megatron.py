"""HF <-> Megatron torch_dist conversion on tiny models of every architecture (one process).

Expected values are independent of the converters: the original HF safetensors, the HF model's
own log-probs, and the checkpoint layout Megatron-Core's own `dist_checkpointing.save` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from megatron_rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_rl.convert.megatron_to_hf import convert_megatron_to_hf

# name -> (arch, overrides, tp, pp): tied embeddings, QKV bias (qwen2), QK norm (qwen3), one KV head
CASES = {
    "llama": ("llama", {"num_hidden_layers": 4}, 2, 2),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True, "num_hidden_layers": 4}, 2, 2),
    "qwen3": ("qwen3", {"num_hidden_layers": 4}, 2, 2),
    "qwen3_one_kv_head": ("qwen3", {"num_key_value_heads": 1, "num_hidden_layers": 4}, 1, 2),
}


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def hf_logprobs(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1 from the HF model itself, [B, S-1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


def load_model_only(actor, ckpt_dir: Path) -> None:
    """What the trainer does with a converted folder: model weights only, strict on both sides."""
    from megatron.core import dist_checkpointing

    from megatron_rl.actor.forward import unwrap_model

    model = unwrap_model(actor.model[0])
    state = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="")}, str(ckpt_dir),
                                    strict="raise_all")
    model.load_state_dict(state["model"])


@pytest.fixture(params=sorted(CASES))
def case(request, tiny_hf_factory) -> tuple[str, Path, int, int]:
    arch, overrides, tp, pp = CASES[request.param]
    return request.param, tiny_hf_factory(arch, **overrides), tp, pp


def test_roundtrip_is_bitwise_identical(case, tmp_path):
    name, hf_dir, tp, pp = case
    convert_hf_to_megatron(hf_dir, tmp_path / "mcore", tp=tp, pp=pp, progress=False)
    summary = convert_megatron_to_hf(tmp_path / "mcore", tmp_path / "hf", max_shard_bytes=200_000,
                                     progress=False)
    original, back = hf_tensors(hf_dir), hf_tensors(tmp_path / "hf")
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert summary.num_tensors == len(original)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1  # really sharded
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    config, config_back = (json.loads((d / "config.json").read_text()) for d in (hf_dir, tmp_path / "hf"))
    assert config_back == config
    assert (tmp_path / "hf" / "generation_config.json").read_text() == \
        (hf_dir / "generation_config.json").read_text()


def test_bf16_storage_roundtrip(qwen2_dir, tmp_path):
    convert_hf_to_megatron(qwen2_dir, tmp_path / "mcore", tp=2, dtype="bf16", progress=False)
    dtypes = {md.properties.dtype for md in FileSystemReader(tmp_path / "mcore").read_metadata()
              .state_dict_metadata.values() if hasattr(md, "properties")}
    assert dtypes == {torch.bfloat16}
    convert_megatron_to_hf(tmp_path / "mcore", tmp_path / "hf", progress=False)
    back = hf_tensors(tmp_path / "hf")
    for key, tensor in hf_tensors(qwen2_dir).items():
        assert torch.equal(back[key], tensor.to(torch.bfloat16)), key
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def _layout(ckpt_dir: Path) -> dict:
    """key -> (kind, global size, dtype, sorted chunk boxes) from the DCP metadata."""
    out = {}
    for key, md in FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata.items():
        if hasattr(md, "chunks"):
            boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            out[key] = ("tensor", tuple(md.size), md.properties.dtype, boxes)
        else:
            out[key] = ("bytes",)
    return out


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("qwen3", False), ("llama", False)])
def test_layout_matches_megatron_own_save(arch, tied, tiny_hf_factory, single_parallel, tmp_path):
    """Same keys, global shapes, dtypes and chunk boxes as Megatron writes at TP=1 (TP=2: tests/dist)."""
    from megatron.core import dist_checkpointing

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.forward import unwrap_model

    hf_dir = tiny_hf_factory(arch, tie_word_embeddings=tied)
    actor = MegatronActor.build(hf_dir, parallel=single_parallel)
    (tmp_path / "megatron").mkdir()
    dist_checkpointing.save({"model": unwrap_model(actor.model[0]).sharded_state_dict(prefix="")},
                            str(tmp_path / "megatron"))
    convert_hf_to_megatron(hf_dir, tmp_path / "ours", tp=1, progress=False)
    assert _layout(tmp_path / "ours") == _layout(tmp_path / "megatron")


@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3_one_kv_head"])
def test_actor_loads_converted_checkpoint(name, tiny_hf_factory, single_parallel, tmp_path):
    """Loaded into a randomly initialized actor: its export is the HF checkpoint, its log-probs the HF model's."""
    from megatron_rl.actor.actor import MegatronActor

    arch, overrides, tp, pp = CASES[name]
    hf_dir = tiny_hf_factory(arch, **overrides)
    convert_hf_to_megatron(hf_dir, tmp_path / "mcore", tp=tp, pp=pp, progress=False)
    actor = MegatronActor.build(hf_dir, parallel=single_parallel, load_weights=False, seed=123)
    load_model_only(actor, tmp_path / "mcore")
    exported = dict(actor.export_hf_weights())
    for key, tensor in hf_tensors(hf_dir).items():
        assert torch.equal(exported[key], tensor), key
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    batch = {"tokens": tokens, "loss_mask": torch.ones(2, 11)}
    ours = actor.compute_logprobs(batch, micro_batch_size=1, with_entropy=False)["logprobs"][:, 1:]
    torch.testing.assert_close(ours, hf_logprobs(hf_dir, tokens), rtol=1e-5, atol=1e-5)


def _train_one_step(actor) -> None:
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    batch = {"tokens": tokens, "loss_mask": torch.ones(2, 9)}

    def loss_fn(logprobs, entropy, mb):
        total = -(logprobs * mb["loss_mask"]).sum()
        return total / 18.0, {"nll": torch.stack([total.detach().double(), torch.tensor(18.0).double()])}

    assert not actor.train_step(batch, loss_fn, micro_batch_size=2)["skipped"]


def test_trainer_checkpoint_to_hf(qwen3_dir, single_parallel, tmp_path):
    """A trainer checkpoint (model + Adam state, step folder, `latest`) converts to what the actor exports."""
    from megatron_rl.actor.actor import MegatronActor

    actor = MegatronActor.build(qwen3_dir, parallel=single_parallel, lr=1e-2)
    _train_one_step(actor)  # weights move away from the HF files; Adam state exists
    root = tmp_path / "checkpoints"
    (root / "step_000003" / "model").mkdir(parents=True)
    actor.save_checkpoint(root / "step_000003" / "model")
    (root / "latest").write_text("3")
    with pytest.raises(ValueError, match="pass --hf-config-dir"):  # the trainer records no HF config
        convert_megatron_to_hf(root, tmp_path / "hf", progress=False)
    summary = convert_megatron_to_hf(root, tmp_path / "hf", hf_config_dir=qwen3_dir, progress=False)
    back, exported = hf_tensors(tmp_path / "hf"), dict(actor.export_hf_weights())
    assert sorted(back) == sorted(exported)
    assert all(torch.equal(back[k], v) for k, v in exported.items())
    assert not torch.equal(back["model.norm.weight"], hf_tensors(qwen3_dir)["model.norm.weight"])
    assert summary.details["checkpoint"].endswith("step_000003/model")
    assert not summary.details["ignored"].startswith("0 ")  # the optimizer state was skipped


def test_fp8_trainer_checkpoint_to_hf(qwen2_dir, single_parallel, tmp_path):
    """FP8 delayed-scaling state saved next to the weights (fp8_state buffers) is skipped."""
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.fp8.recipe import Fp8Recipe

    recipe = Fp8Recipe.from_contract("delayed", "hybrid")
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, fp8_recipe=recipe)
    (tmp_path / "model").mkdir()
    actor.save_checkpoint(tmp_path / "model")
    keys = FileSystemReader(tmp_path / "model").read_metadata().state_dict_metadata
    assert any(".fp8_state." in key for key in keys)
    convert_megatron_to_hf(tmp_path / "model", tmp_path / "hf", hf_config_dir=qwen2_dir, progress=False)
    back = hf_tensors(tmp_path / "hf")
    assert all(torch.equal(back[k], v) for k, v in hf_tensors(qwen2_dir).items())


def test_per_layer_keys_checkpoint_to_hf(llama_dir, single_parallel, tmp_path):
    """Megatron's non-homogeneous spelling (`decoder.layers.{i}.X`, no layer axis) reads too."""
    from megatron.core import dist_checkpointing

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.forward import unwrap_model

    actor = MegatronActor.build(llama_dir, parallel=single_parallel)
    model = unwrap_model(actor.model[0])
    sharded = model.sharded_state_dict(prefix="", metadata={"non_homogeneous_layers": True})
    (tmp_path / "model").mkdir()
    dist_checkpointing.save({"model": sharded}, str(tmp_path / "model"))
    keys = FileSystemReader(tmp_path / "model").read_metadata().state_dict_metadata
    assert "decoder.layers.1.mlp.linear_fc2.weight" in keys
    convert_megatron_to_hf(tmp_path / "model", tmp_path / "hf", hf_config_dir=llama_dir, progress=False)
    back = hf_tensors(tmp_path / "hf")
    assert all(torch.equal(back[k], v) for k, v in hf_tensors(llama_dir).items())


def test_checkpoint_carries_hf_config_and_tp_pp(llama_dir, tmp_path):
    convert_hf_to_megatron(llama_dir, tmp_path / "mcore", tp=2, progress=False)
    common = torch.load(tmp_path / "mcore" / "common.pt", weights_only=True)
    meta = common["content_metadata"]
    assert meta["tensor_model_parallel_size"] == 2 and meta["pipeline_model_parallel_size"] == 1
    assert meta["hf_config"] == json.loads((llama_dir / "config.json").read_text())
    assert json.loads((tmp_path / "mcore" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    # Without the hf/ side folder the config still comes from common.pt.
    for file in (tmp_path / "mcore" / "hf").iterdir():
        file.unlink()
    (tmp_path / "mcore" / "hf").rmdir()
    convert_megatron_to_hf(tmp_path / "mcore", tmp_path / "hf", progress=False)
    assert all(torch.equal(hf_tensors(tmp_path / "hf")[k], v) for k, v in hf_tensors(llama_dir).items())
