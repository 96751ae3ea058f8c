"""Bad configs, folders, tensors and batches give a ValueError that names the culprit."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.actor.actor import MegatronActor


def copy_with(src, dst, change) -> None:
    """Copy a tiny HF folder, applying change(dict of tensors) to its weights."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_missing_folder(single_parallel, tmp_path, qwen2_dir):
    with pytest.raises(ValueError, match="no_such_model"):
        MegatronActor.build(tmp_path / "no_such_model", parallel=single_parallel)
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel, load_weights=False)
    with pytest.raises(ValueError, match="folder not found: .*gone"):
        actor.load_hf(tmp_path / "gone")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        actor.load_hf(empty)


def test_missing_tensor(single_parallel, tmp_path, qwen2_dir):
    bad = tmp_path / "bad"
    copy_with(qwen2_dir, bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        MegatronActor.build(bad, parallel=single_parallel)


def test_wrong_shape(single_parallel, tmp_path, qwen3_dir):
    bad = tmp_path / "bad"
    copy_with(qwen3_dir, bad, lambda t: t.update(
        {"model.layers.0.self_attn.k_norm.weight": torch.ones(16)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight.*\(16,\).*\(32,\)"):
        MegatronActor.build(bad, parallel=single_parallel)


def test_bad_config_values(single_parallel, tmp_path, qwen2_dir):
    bad = tmp_path / "bad"
    shutil.copytree(qwen2_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(config, model_type="mistral")))
    with pytest.raises(ValueError, match="model_type='mistral'"):
        MegatronActor.build(bad, parallel=single_parallel)
    with pytest.raises(ValueError, match="clip_grad=-1"):
        MegatronActor.build(qwen2_dir, parallel=single_parallel, clip_grad=-1.0)
    with pytest.raises(ValueError, match="params_dtype"):
        MegatronActor.build(qwen2_dir, parallel=single_parallel, params_dtype=torch.float16)


def test_parallel_sizes_must_fit_the_world(single_parallel):
    from megatron_rl.actor.parallel import init_parallel

    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        init_parallel(2, 1)


def test_sharded_index_and_a_missing_shard(single_parallel, tmp_path):
    from megatron_rl.models.tiny import make_tiny_hf_model

    model = make_tiny_hf_model("llama", None)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    actor = MegatronActor.build(tmp_path / "sharded", parallel=single_parallel)
    exported = dict(actor.export_hf_weights())
    assert all(torch.equal(exported[n], t) for n, t in model.state_dict().items())
    (tmp_path / "sharded" / files[-1]).unlink()
    with pytest.raises(ValueError, match=files[-1]):
        actor.load_hf(tmp_path / "sharded")


def test_bad_batches(single_parallel, qwen2_dir):
    actor = MegatronActor.build(qwen2_dir, parallel=single_parallel)
    good = {"tokens": torch.zeros(2, 6, dtype=torch.int64), "loss_mask": torch.ones(2, 6)}
    with pytest.raises(ValueError, match="tokens"):
        actor.compute_logprobs(dict(good, tokens=good["tokens"].float()), micro_batch_size=1)
    with pytest.raises(ValueError, match=r"outside \[0, 128\)"):
        actor.compute_logprobs(dict(good, tokens=good["tokens"] + 200), micro_batch_size=1)
    with pytest.raises(ValueError, match="loss_mask"):
        actor.train_step({"tokens": good["tokens"]}, lambda *a: None, micro_batch_size=1)
    with pytest.raises(ValueError, match="scalar loss"):
        actor.train_step(good, lambda lp, ent, mb: (lp, {}), micro_batch_size=1)
