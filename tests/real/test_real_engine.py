"""The real model in the embedded rollout engine: the block-FP8 rollout checkpoint served (partial
128-blocks: hidden 576 = 4.5 blocks, k/v 192 = 1.5), the trainer's weight sync landing exactly those
bytes, generation from the real chat template ending at <|im_end|>, log-probs against transformers'
recompute, and SGLang's refusal of the same checkpoint named before any server starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.actor.actor import MegatronActor
from megatron_rl.convert.hf_to_fp8 import convert_hf_to_fp8
from megatron_rl.fp8.rollout_quant import RolloutQuantSpec
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_checkpoint import check_block_alignment
from megatron_rl.rollout.torch_engine import TorchRolloutEngine
from megatron_rl.sync.transport import InProcessTransport
from megatron_rl.sync.weight_sync import WeightSync

IM_END = 2
QUESTION = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


@pytest.fixture(scope="module")
def fp8_checkpoint(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2_fp8") / "ckpt"
    convert_hf_to_fp8(smollm2_dir, out, progress=False)
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def chat_prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_fp8_checkpoint_has_partial_blocks_and_the_sync_sends_its_bytes(
        smollm2_dir, smollm2_tokenizer, fp8_checkpoint, single_parallel):
    q = fp8_checkpoint["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    k = fp8_checkpoint["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    down = fp8_checkpoint["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert (q.shape, k.shape, down.shape) == ((5, 5), (2, 5), (5, 12))  # ceil(576/128) = 5, ceil(192/128) = 2
    served = TorchRolloutEngine(smollm2_dir, rollout_quant="fp8_blockwise", tokenizer=smollm2_tokenizer)
    served.update_weights(fp8_checkpoint.items(), version=1)
    served.finish_update(1)
    synced = TorchRolloutEngine(smollm2_dir, rollout_quant="fp8_blockwise", tokenizer=smollm2_tokenizer)
    actor = MegatronActor.build(smollm2_dir, parallel=single_parallel)
    sync = WeightSync(actor, InProcessTransport(synced), RolloutQuantSpec("fp8_blockwise"), bucket_mb=64, check=True)
    sync.sync()  # check=True: WeightSyncError unless the engine holds every digest that was sent
    assert synced.weight_version == 1
    held = served.checksum()
    assert len(held) == 30 * (7 + 7 + 2) + 3 and synced.checksum() == held  # linears + scales + norms; embed, lm_head, norm
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    a, b = served.generate([chat_prompt(smollm2_tokenizer)], sampling)[0], \
        synced.generate([chat_prompt(smollm2_tokenizer)], sampling)[0]
    assert a.response_ids == b.response_ids and a.rollout_logprobs == b.rollout_logprobs
    assert a.finish_reason == "stop" and a.response_ids[-1] == IM_END and IM_END not in a.response_ids[:-1]
    answer = smollm2_tokenizer.decode(a.response_ids, skip_special_tokens=True)
    print(f"FP8 SmolLM2 answers {answer!r}")
    assert "7" in answer  # BF16 greedy: "Tom has 3 apples and 4 more apples, so he has 3 + 4 = 7 apples."


def test_bf16_engine_logprobs_are_transformers_recompute(smollm2_dir, smollm2_tokenizer, smollm2_model):
    engine = TorchRolloutEngine(smollm2_dir, tokenizer=smollm2_tokenizer)
    prompt = chat_prompt(smollm2_tokenizer)
    samples = engine.generate([prompt, prompt[:-3] + prompt[-3:]], SamplingParams(temperature=1.0, max_new_tokens=12,
                                                                                     seed=3, n=2))
    for sample in samples:
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(smollm2_model(ids).logits.float(), dim=-1)[0]
        start = len(sample.prompt_ids)
        ref = logp[start - 1:-1].gather(-1, ids[0, start:, None])[:, 0]
        assert torch.allclose(torch.tensor(sample.rollout_logprobs), ref, atol=1e-4, rtol=0)
        assert sample.finish_reason == ("stop" if sample.response_ids[-1] == IM_END else "length")
    assert len({tuple(s.response_ids) for s in samples}) > 1  # sampled, not greedy


def test_sglang_refuses_the_128_block_checkpoint_before_a_server_starts(smollm2_dir):
    spec = RolloutQuantSpec("fp8_blockwise", (128, 128))
    with pytest.raises(ValueError) as err:
        check_block_alignment(smollm2_dir, spec)
    message = str(err.value)
    for part in ("input dims {'hidden_size': 576, 'num_attention_heads * head_dim': 576}",
                 "merged output partitions {'q': 576, 'k': 192, 'v': 192}", "a block that fits: [64, 64]"):
        assert part in message
    assert "intermediate_size" not in message and "gate/up" not in message  # 1536 = 12 blocks
    check_block_alignment(smollm2_dir, RolloutQuantSpec("fp8_blockwise", (64, 64)))  # 576 = 9 x 64, 192 = 3 x 64
