"""Packed micro-batches: packing by hand, and packed == padded (log-probs, loss, gradients)."""

import pytest
import torch

from megatron_rl.actor.packing import (as_sequences, pack_batch, pad_multiple, per_sequence,
                                       plan_packs, sequence_lengths, unpack)


def test_pad_multiple_by_recipe_and_sequence_parallel():
    assert pad_multiple("blockwise", 1, False) == 128
    assert pad_multiple("mxfp8", 4, False) == 32
    assert pad_multiple("mxfp8", 4, True) == 128
    assert pad_multiple("bf16", 2, True) == 32 and pad_multiple("delayed", 8, False) == 16
    assert pad_multiple("nvfp4", 1, False) == 32 and pad_multiple("mxfp4", 2, True) == 64


def test_plan_packs_first_fit_decreasing_by_hand():
    # sorted: 7 (i=1), 5 (i=3), 4 (i=0), 3 (i=4), 2 (i=2); budget 9
    assert plan_packs([4, 7, 2, 5, 3, 0], 9) == [[1, 2], [3, 0], [4]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=6"):
        plan_packs([7], 6)


def test_pack_and_unpack_by_hand():
    tokens = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 9, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
    batch = {"tokens": tokens, "loss_mask": mask, "adv": mask * 2, "lengths": torch.tensor([3, 4, 2])}
    assert sequence_lengths(mask).tolist() == [3, 4, 0]  # row 1 stops at its last loss token
    packed, index = pack_batch(batch, budget=7, multiple=4)
    assert sorted(packed) == ["adv", "loss_mask", "seq_lens", "tokens"]
    assert packed["tokens"].tolist() == [[4, 5, 6, 7, 1, 2, 3, 0]]
    assert packed["seq_lens"].tolist() == [[4, 3]]
    assert packed["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 1, 0]]
    back = unpack(packed["adv"], index)
    assert back.tolist() == [[0, 2, 2, 0, 0], [0, 0, 2, 2, 0], [0, 0, 0, 0, 0]]
    rows = as_sequences(packed["tokens"], packed["seq_lens"])
    assert rows.tolist() == [[4, 5, 6, 7], [1, 2, 3, 0]]
    empty, _ = pack_batch({"tokens": tokens, "loss_mask": mask * 0}, budget=7, multiple=4)
    assert empty["tokens"].shape == (1, 4) and empty["seq_lens"].tolist() == [[0]]


def _rl_batch(num: int, width: int, seed: int) -> dict:
    """Right-padded prompt + response rows of spread-out lengths, as loop/batch.collate makes them."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(num, width, dtype=torch.int64)
    mask = torch.zeros(num, width)
    for row in range(num):
        prompt = 2 + row % 3
        length = int(torch.randint(prompt + 1, width + 1, (1,), generator=gen))
        tokens[row, :length] = torch.randint(1, 128, (length,), generator=gen)
        mask[row, prompt:length] = 1.0
    adv = torch.randn(num, 1, generator=gen) * mask
    old = -torch.rand(num, width, generator=gen) * mask
    return {"tokens": tokens, "loss_mask": mask, "advantages": adv, "old_logprobs": old,
            "rollout_logprobs": old + 0.01 * mask}


def _policy_loss_fn(mode: str, denominator: float):
    from megatron_rl.algo.policy_loss import LossSpec, policy_loss

    def loss_fn(logprobs, entropy, mb):
        logprobs, entropy, mb = per_sequence(logprobs, entropy, mb)
        return policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["loss_mask"],
                           LossSpec(loss_agg_mode=mode, clip_low=0.8, clip_high=1.2, entropy_coef=0.01),
                           denominator=denominator, rollout_logprobs=mb["rollout_logprobs"],
                           entropy=entropy)
    return loss_fn


def _grads(actor) -> list[torch.Tensor]:
    return [p.main_grad.clone() for p in actor.model[0].parameters()]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_packed_equals_padded_logprobs_loss_grads(qwen3_dir, single_parallel, mode):
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.algo.policy_loss import loss_denominator

    batch = _rl_batch(6, 14, seed=5)
    denominator = float(loss_denominator(batch["loss_mask"], mode))
    packed, index = pack_batch(batch, budget=20, multiple=16)
    assert packed["tokens"].shape[0] < 6  # really packed: fewer rows than sequences
    results = {}
    for name, actor_batch, mbs in (("padded", batch, 2), ("packed", packed, 1)):
        actor = MegatronActor.build(qwen3_dir, parallel=single_parallel, lr=1e-2)
        out = actor.compute_logprobs(actor_batch, micro_batch_size=mbs, logprob_chunk_size=4)
        step = actor.train_step(actor_batch, _policy_loss_fn(mode, denominator), micro_batch_size=mbs,
                                logprob_chunk_size=4)
        lp = out["logprobs"] if name == "padded" else unpack(out["logprobs"], index)
        results[name] = (lp, step["loss"], _grads(actor))
    (lp_pad, loss_pad, g_pad), (lp_pack, loss_pack, g_pack) = results["padded"], results["packed"]
    assert lp_pad.abs().sum() > 0
    torch.testing.assert_close(lp_pack, lp_pad, rtol=0, atol=1e-6)
    assert loss_pack == pytest.approx(loss_pad, rel=1e-6, abs=1e-7)
    for a, b in zip(g_pack, g_pad):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_thd_params_by_hand():
    """The TE path's cu_seqlens: sequences, then the trailing padding as one more sequence."""
    from megatron_rl.actor.packing import thd_params

    params = thd_params(torch.tensor([[4, 3, 0]]), width=8)
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 4, 7, 8]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == 4
    assert params.max_seqlen_kv == 4 and params.cu_seqlens_kv.tolist() == [0, 4, 7, 8]
    assert thd_params(torch.tensor([[5, 3]]), width=8).cu_seqlens_kv.tolist() == [0, 5, 8]
    ones = thd_params(torch.tensor([[1, 1, 0]]), width=4)  # one-token sequences are sequences too
    assert ones.cu_seqlens_q.tolist() == [0, 1, 2, 4] and ones.max_seqlen_q == 2
    with pytest.raises(AssertionError, match="^THD packing takes one packed row per micro-batch$"):
        thd_params(torch.tensor([[4], [3]]), width=8)


def test_token_budget_config_errors_name_the_key():
    from megatron_rl.config import load_config

    with pytest.raises(ValueError, match="train.max_tokens_per_micro_batch"):
        load_config(None, ["train.max_tokens_per_micro_batch=50", "data.max_prompt_len=40",
                           "rollout.max_new_tokens=16"])
    with pytest.raises(ValueError, match="train.logprob_chunk_size"):
        load_config(None, ["train.logprob_chunk_size=-1"])
    assert load_config(None, ["train.max_tokens_per_micro_batch=56", "data.max_prompt_len=40",
                              "rollout.max_new_tokens=16"]).train.max_tokens_per_micro_batch == 56


def test_three_sequences_in_a_row_and_per_token_vectors_by_hand():
    """A row of three sequences (the third starts after both others), a [B, S, 2] per-token tensor
    packed and unpacked with its trailing dimension, and a [B] tensor left out."""
    tokens = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0], [6, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)
    pair = torch.stack((tokens * 10, -tokens), dim=-1).float()  # [3, 4, 2]
    batch = {"tokens": tokens, "loss_mask": mask, "pair": pair, "lengths": torch.tensor([2, 3, 1])}
    packed, index = pack_batch(batch, budget=8, multiple=4)
    # first-fit decreasing: 3 (row 1), 2 (row 0), 1 (row 2), all in one row of 6 -> width 8
    assert packed["tokens"].tolist() == [[3, 4, 5, 1, 2, 6, 0, 0]]
    assert packed["seq_lens"].tolist() == [[3, 2, 1]]
    assert (index.row.tolist(), index.offset.tolist(), index.length.tolist()) == ([0, 0, 0], [3, 0, 5], [2, 3, 1])
    assert packed["pair"].shape == (1, 8, 2)
    assert packed["pair"][0, :, 0].tolist() == [30, 40, 50, 10, 20, 60, 0, 0]
    assert packed["pair"][0, :, 1].tolist() == [-3, -4, -5, -1, -2, -6, 0, 0]
    back = unpack(packed["pair"], index)
    assert back.shape == (3, 4, 2)
    torch.testing.assert_close(back, pair * (torch.arange(4) < torch.tensor([[2], [3], [1]]))[..., None])
    assert "lengths" not in packed


def test_a_batch_of_zero_width_has_no_sequence():
    lengths = sequence_lengths(torch.zeros(3, 0))
    assert lengths.tolist() == [0, 0, 0] and lengths.dtype == torch.int64


def test_plan_packs_boundaries():
    assert plan_packs([6], 6) == [[0]]  # exactly the budget fits
    assert plan_packs([1, 0, 1], 4) == [[0, 2]]  # one-token sequences are packed, empty ones not


def test_as_sequences_cuts_each_sequence_at_its_length():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 0.0]])
    rows = as_sequences(values, torch.tensor([[2, 3]]))
    assert rows.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]  # not the next sequence's first token
    assert as_sequences(values, torch.tensor([[1, 1]])).tolist() == [[1.0], [2.0]]
    vectors = torch.stack((values, -values), dim=-1)  # [1, W, 2]
    assert as_sequences(vectors, torch.tensor([[2, 1]])).tolist() == [[[1.0, -1.0], [2.0, -2.0]],
                                                                      [[3.0, -3.0], [0.0, 0.0]]]
    for bad_values, bad_lens in ((torch.zeros(2, 6), torch.tensor([[2, 3]])),
                                 (torch.zeros(1, 6), torch.tensor([[2], [3]]))):
        with pytest.raises(AssertionError, match="^one packed row per micro-batch$"):
            as_sequences(bad_values, bad_lens)
