"""Log-probs / entropy kernel against a full-softmax reference; batch helpers; packed == padded."""

import pytest
import torch

from megatron_rl.actor.batch import (attention_mask_of, position_ids_of, segment_ids,
                                     sequence_starts, split_micro_batches, validate_batch)
from megatron_rl.actor.logprobs import vocab_parallel_logprobs_and_entropy


def test_kernel_matches_full_softmax_values_and_grads():
    gen = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(2, 7, 50, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 50, (2, 7), generator=gen)
    lp, ent = vocab_parallel_logprobs_and_entropy(logits, targets, None)
    ref_logits = logits.detach().clone().requires_grad_()
    logp = torch.log_softmax(ref_logits, dim=-1)
    ref_lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-6, atol=1e-6)
    weights = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    ((lp.double() + 0.3 * ent.double()) * weights).sum().backward()
    ((ref_lp + 0.3 * ref_ent) * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)


def test_kernel_uniform_logits_by_hand():
    logits = torch.zeros(1, 1, 8)
    lp, ent = vocab_parallel_logprobs_and_entropy(logits, torch.tensor([[3]]), None)
    assert lp.item() == pytest.approx(-torch.log(torch.tensor(8.0)).item(), abs=1e-6)
    assert ent.item() == pytest.approx(torch.log(torch.tensor(8.0)).item(), abs=1e-6)


def test_packed_helpers_by_hand():
    batch = {"tokens": torch.zeros(1, 7, dtype=torch.int64), "seq_lens": torch.tensor([[3, 2, 0]])}
    assert segment_ids(batch["seq_lens"], 7).tolist() == [[0, 0, 0, 1, 1, 3, 3]]
    assert position_ids_of(batch).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert sequence_starts(batch).tolist() == [[True, False, False, True, False, True, False]]
    mask = attention_mask_of(batch)[0, 0]
    allowed = (~mask).int().tolist()
    assert allowed[2] == [1, 1, 1, 0, 0, 0, 0]
    assert allowed[4] == [0, 0, 0, 1, 1, 0, 0]
    assert attention_mask_of({"tokens": batch["tokens"]}) is None


def test_micro_batch_split_and_validation():
    batch = {"tokens": torch.arange(12).reshape(4, 3), "loss_mask": torch.ones(4, 3),
             "advantages": torch.arange(4.0), "note": "shared"}
    parts = split_micro_batches(batch, 2)
    assert [p["advantages"].tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0]]
    assert parts[1]["tokens"].tolist() == [[6, 7, 8], [9, 10, 11]] and parts[0]["note"] == "shared"
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        validate_batch(batch, 128, 3)
    with pytest.raises(ValueError, match="loss_mask"):
        validate_batch({"tokens": batch["tokens"]}, 128, 2)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        validate_batch(batch, 10, 2)
    with pytest.raises(ValueError, match="advantages"):
        validate_batch(dict(batch, advantages=torch.ones(3)), 128, 2)
    with pytest.raises(ValueError, match="seq_lens"):
        validate_batch(dict(batch, seq_lens=torch.tensor([[2, 2]] * 4)), 128, 2)


def test_packed_rows_equal_padded_rows(qwen3_dir, single_parallel):
    """Two sequences packed in one row give the log-probs they get on their own padded rows."""
    from megatron_rl.actor.actor import MegatronActor

    actor = MegatronActor.build(qwen3_dir, parallel=single_parallel)
    gen = torch.Generator().manual_seed(2)
    first, second = torch.randint(0, 128, (9,), generator=gen), torch.randint(0, 128, (6,), generator=gen)
    padded = torch.zeros(2, 16, dtype=torch.int64)
    padded[0, :9], padded[1, :6] = first, second
    packed = torch.zeros(1, 16, dtype=torch.int64)
    packed[0, :15] = torch.cat((first, second))
    out_pad = actor.compute_logprobs({"tokens": padded, "loss_mask": torch.ones(2, 16)},
                                     micro_batch_size=2)
    out_pack = actor.compute_logprobs({"tokens": packed, "loss_mask": torch.ones(1, 16),
                                       "seq_lens": torch.tensor([[9, 6]])}, micro_batch_size=1)
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(out_pack[key][0, :9], out_pad[key][0, :9], rtol=0, atol=1e-5)
        torch.testing.assert_close(out_pack[key][0, 9:15], out_pad[key][1, :6], rtol=0, atol=1e-5)
    assert out_pack["logprobs"][0, 9] == 0  # the second sequence's first token has no prediction
    # Explicit position_ids restarting per sequence are honoured too.
    pos = position_ids_of({"tokens": packed, "seq_lens": torch.tensor([[9, 6]])})
    out_pos = actor.compute_logprobs({"tokens": packed, "loss_mask": torch.ones(1, 16),
                                      "seq_lens": torch.tensor([[9, 6]]), "position_ids": pos},
                                     micro_batch_size=1)
    assert torch.equal(out_pos["logprobs"], out_pack["logprobs"])
