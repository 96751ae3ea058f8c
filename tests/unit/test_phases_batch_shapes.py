"""The loop phases' small pieces by hand: padding a batch's columns for sequence parallel and its
rows for equal micro-batches, and the response-length metrics (truncated = finished by length)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.loop import phases


def _batch(rows: int, width: int) -> dict:
    return {"tokens": torch.arange(rows * width).reshape(rows, width) + 1, "loss_mask": torch.ones(rows, width),
            "advantages": torch.full((rows,), 0.5)}


def test_columns_are_padded_to_the_next_multiple_with_masked_zeros():
    padded = phases.pad_columns(_batch(2, 10), 8)
    assert padded["tokens"].shape == (2, 16) and padded["loss_mask"].shape == (2, 16)
    assert padded["tokens"][:, 10:].eq(0).all() and padded["loss_mask"][:, 10:].eq(0).all()
    assert padded["tokens"][:, :10].equal(_batch(2, 10)["tokens"]) and padded["advantages"].shape == (2,)
    same = _batch(2, 16)
    assert phases.pad_columns(same, 8) is same


def test_rows_are_padded_to_the_next_multiple_with_masked_copies():
    padded, real = phases.pad_rows(_batch(3, 4), 4)
    assert real == 3 and padded["tokens"].shape == (4, 4) and padded["advantages"].shape == (4,)
    assert padded["loss_mask"][3].eq(0).all() and padded["tokens"][3].eq(0).all()
    batch = _batch(4, 4)
    assert phases.pad_rows(batch, 2) == (batch, 4)


def test_truncated_responses_are_those_that_finished_by_length():
    samples = [SimpleNamespace(response_ids=[1] * n, finish_reason=reason)
               for n, reason in ((3, "stop"), (5, "length"), (1, "abort"), (5, "length"))]
    run = SimpleNamespace(parallel=SimpleNamespace(dp_group=None))
    per_sample, longest = phases._length_metrics(run, samples)
    assert per_sample["response_length/mean"].tolist() == [3.0, 5.0, 1.0, 5.0]
    assert per_sample["response_length/clip_ratio"].tolist() == [0.0, 1.0, 0.0, 1.0] and longest == 5.0


def _layout_run(sequence_parallel: bool, tp: int, recipe: str = "tensorwise", budget: int = 0, mbs: int = 2):
    return SimpleNamespace(
        actor=SimpleNamespace(config=SimpleNamespace(sequence_parallel=sequence_parallel)),
        parallel=SimpleNamespace(tp_size=tp),
        cfg=SimpleNamespace(train=SimpleNamespace(max_tokens_per_micro_batch=budget, micro_batch_size=mbs),
                            precision=SimpleNamespace(train_recipe=recipe)))


def test_the_actor_batch_pads_columns_to_the_tp_size_only_under_sequence_parallel():
    batch = _batch(3, 5)
    padded, mbs, restore = phases._actor_batch(_layout_run(True, 4), batch)
    assert mbs == 2 and padded["tokens"].shape == (4, 8) and padded["loss_mask"][:, 5:].eq(0).all()
    assert restore(padded["tokens"]).equal(batch["tokens"])
    plain, _, _ = phases._actor_batch(_layout_run(False, 4), batch)
    assert plain["tokens"].shape == (4, 5)


@pytest.mark.parametrize("recipe, sp, width", [("blockwise", True, 256), ("blockwise", False, 128),
                                               ("tensorwise", True, 32), ("mxfp8", True, 64)])
def test_packed_rows_are_a_multiple_of_the_recipe_block_times_tp_under_sequence_parallel(recipe, sp, width):
    batch = _batch(3, 5)
    packed, mbs, restore = phases._actor_batch(_layout_run(sp, 2, recipe, budget=40), batch)
    assert mbs == 1 and packed["tokens"].shape == (1, width)  # 15 tokens in one row of the budget
    assert restore(packed["tokens"]).equal(batch["tokens"])


def test_reward_components_count_zero_for_every_response_of_a_rank_that_lacks_them(monkeypatch):
    """DP ranks average each reward component over every response; a rank whose rewards gave no
    components at all (plain floats, or every call failed) still weighs in with all of its own."""
    others = []  # the other DP rank's names; the gather returns this rank's own first, as a real one would
    monkeypatch.setattr(phases.collectives, "all_gather_objects", lambda names, group: [names, *others])
    run = SimpleNamespace(parallel=SimpleNamespace(dp_size=2, dp_group=object()))
    others[:] = [["reward/twice"]]  # the other rank has the component, this one nothing
    metrics = {"reward/errors": 0.0}
    means = phases._component_means(run, metrics, 3)
    assert {k: v.tolist() for k, v in means.items()} == {"reward/twice": [0.0, 0.0, 0.0]}
    metrics = {"reward/errors": 1.0, "reward/only": [1.0, 0.5]}
    means = phases._component_means(run, metrics, 2)
    assert {k: v.tolist() for k, v in means.items()} == {"reward/only": [1.0, 0.5], "reward/twice": [0.0, 0.0]}
    assert metrics == {"reward/errors": 1.0}  # the lists are popped: only counts stay to be summed


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_samples_go_from_the_replicas_first_rank_over_the_gloo_twin(monkeypatch, tp, pp):
    """The broadcast itself runs on real ranks (tests/dist/test_rl_loop_ranks.py, the 4-rank grid);
    here, for every layout, which group carries it and which global rank sends: the first of the
    replica's model-parallel group (global ranks 2 and 3 here: the second replica of a grid)."""
    twin, trainer, sent = object(), object(), []
    ranks = {twin: [2, 3], trainer: [2, 3]}
    monkeypatch.setattr(phases.collectives, "global_rank", lambda group, rank: ranks[group][rank])
    monkeypatch.setattr(phases.collectives, "broadcast_object",
                        lambda obj, src, group: sent.append((obj, src, group)) or "received")
    parallel = SimpleNamespace(tp_size=tp, pp_size=pp, mp_group=trainer)
    with_twin = phases._broadcast_from_engine_rank(["s"], parallel, SimpleNamespace(mp=twin))
    without = phases._broadcast_from_engine_rank(["s"], parallel, None)
    if tp * pp == 1:
        assert (with_twin, without, sent) == (["s"], ["s"], [])  # one rank per replica: nothing to send
    else:
        assert (with_twin, without) == ("received", "received")
        assert sent == [(["s"], 2, twin), (["s"], 2, trainer)]  # no gloo twin: the trainer's own group
