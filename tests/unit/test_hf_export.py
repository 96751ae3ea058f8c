"""checkpoint.save_hf_every's writer: the trainer's weights as an HF folder that transformers loads,
with log-probs equal to the trainer's own; atomic."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.data import build_char_tokenizer
from megatron_rl.loop.hf_export import export_hf


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_export_loads_and_matches_the_trainers_logprobs(arch, tiny_hf_factory, single_parallel, tmp_path):
    hf_dir = tiny_hf_factory(arch)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((hf_dir / "config.json").read_text())
    build_char_tokenizer().save_pretrained(src)
    actor = MegatronActor.build(hf_dir, parallel=single_parallel)
    for param in actor.model[0].parameters():  # trained weights differ from the checkpoint's
        param.data.add_(0.01 * torch.randn_like(param))
    out = export_hf(actor, single_parallel, src, tmp_path / "hf" / "step_000003")
    assert out == tmp_path / "hf" / "step_000003" and (out / "tokenizer_config.json").exists()
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["step_000003"]  # no partial folder left
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    torch.manual_seed(0)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 12))
    mask = torch.zeros(2, 12)
    mask[:, 4:] = 1.0
    trainer = actor.compute_logprobs({"tokens": tokens, "loss_mask": mask}, micro_batch_size=2,
                                     with_entropy=False, fp8=False)["logprobs"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    reference = torch.zeros(2, 12)
    reference[:, 1:] = logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]  # log p(t | tokens before t)
    on = mask > 0
    assert torch.allclose(trainer[on], reference[on], atol=1e-4)
    again = export_hf(actor, single_parallel, src, out)  # an existing export is replaced whole
    assert again == out and len(list(out.glob("*.safetensors"))) == 1
