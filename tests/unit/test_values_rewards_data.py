"""Value tests of rewards/, data/ and telemetry/stats: which "Answer:" DAPO's reward reads, reward
components aligned with their samples when one sample fails, the pool's chunk sizes, the loader's
per-epoch orders across a resume and its last batch, Fisher's test on a table with ties."""

from __future__ import annotations

import random

import pytest

from megatron_rl.data.loader import PromptLoader
from megatron_rl.rewards.dapo import INVALID, TAIL_CHARS, dapo_reward
from megatron_rl.rewards.runner import RewardRunner, _chunks
from megatron_rl.telemetry.stats import fisher_exact


def test_dapo_reads_the_last_answer_inside_the_tail():
    assert dapo_reward("Answer: 3\nno wait\nAnswer: 4", "4")["score"] == 1.0
    assert dapo_reward("Answer: 4\nno wait\nAnswer: 3", "4") == {"score": -1.0, "acc": 0.0, "pred": "3"}
    early = "Answer: 4\n" + "x" * TAIL_CHARS  # the only answer lies before the searched tail
    assert dapo_reward(early, "4") == {"score": -1.0, "acc": 0.0, "pred": INVALID}


def graded(response, answer):
    if response == "boom":
        raise RuntimeError("grader down")
    return {"score": float(response == answer), "fmt": float(len(response))}


@pytest.mark.parametrize("workers", [1, 2])
def test_components_stay_aligned_with_their_samples_after_a_failure(workers):
    with RewardRunner(graded, timeout_s=60.0, num_workers=workers) as runner:
        rewards, stats = runner.score(["a", "boom", "ccc", "dd"], ["a", "x", "c", "dd"])
    assert rewards == [1.0, 0.0, 0.0, 1.0]
    assert stats["components"] == {"fmt": [1.0, 0.0, 3.0, 2.0]}  # the failed sample's slot holds 0
    assert stats["num_errors"] == 1


@pytest.mark.parametrize("count, workers, sizes", [
    (16, 3, [2] * 8),  # 12 parts: ceil(16 / 12) = 2 items each
    (12, 3, [1] * 12),
    (13, 3, [2] * 6 + [1]),
    (5, 8, [1] * 5),
])
def test_pool_chunk_sizes(count, workers, sizes):
    assert [len(c) for c in _chunks(count, workers, False)] == sizes


def _dataset(n):
    return [f"p{i}" for i in range(n)]


def test_each_epoch_has_its_own_order_and_a_resume_in_a_later_epoch_continues_it():
    data = _dataset(10)
    run = PromptLoader(data, batch_size=4, seed=3)
    batches = [run.next_batch() for _ in range(8)]  # 32 items: epochs 0, 1, 2 and part of 3
    epochs = [[p for b in batches for p in b][10 * e:10 * e + 10] for e in range(3)]
    assert all(sorted(e) == data for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # three different permutations
    first = PromptLoader(data, batch_size=4, seed=3)
    for _ in range(4):  # 16 items: stops inside epoch 1
        first.next_batch()
    resumed = PromptLoader(data, batch_size=4, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.next_batch() for _ in range(4)] == batches[4:]


def test_a_loader_of_num_epochs_drops_the_last_partial_batch():
    loader = PromptLoader(_dataset(5), batch_size=3, seed=0, num_epochs=2)  # 10 items: 3 full batches
    assert loader.num_batches == 3
    assert len(list(loader)) == 3
    with pytest.raises(StopIteration):
        loader.next_batch()
    assert PromptLoader(_dataset(5), batch_size=5, seed=0, num_epochs=1).num_batches == 1


def test_fisher_exact_counts_the_tables_as_likely_as_the_observed_one():
    # 3 of 4 against 1 of 4: margins 4, 4, 4; P(a) = C(4,a) C(4,4-a) / 70 = 1, 16, 36, 16, 1 (/ 70).
    # a = 1 is as likely as the observed a = 3: p = (1 + 16 + 16 + 1) / 70 (R: fisher.test 0.4857).
    assert fisher_exact(3, 4, 1, 4) == pytest.approx(34 / 70)
    assert fisher_exact(2, 4, 2, 4) == pytest.approx(1.0)
    assert fisher_exact(4, 4, 0, 4) == pytest.approx(2 / 70)


def test_fisher_exact_against_enumeration_on_random_tables():
    from math import comb

    rng = random.Random(0)
    for _ in range(30):
        n_a, n_b = rng.randint(1, 8), rng.randint(1, 8)
        e_a, e_b = rng.randint(0, n_a), rng.randint(0, n_b)
        total = comb(n_a + n_b, e_a + e_b)
        probs = {a: comb(n_a, a) * comb(n_b, e_a + e_b - a) / total
                 for a in range(0, n_a + 1) if 0 <= e_a + e_b - a <= n_b}
        expected = sum(p for p in probs.values() if p <= probs[e_a] * (1 + 1e-7))
        assert fisher_exact(e_a, n_a, e_b, n_b) == pytest.approx(min(1.0, expected))


def test_two_reward_files_of_the_same_name_are_two_rewards(tmp_path):
    from megatron_rl.rewards.user import load_user_fn

    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "reward.py").write_text(f"def score(response, answer):\n    return {value}\n")
    first = load_user_fn(f"{tmp_path}/a/reward.py:score")
    second = load_user_fn(f"{tmp_path}/b/reward.py:score")
    assert (first("x", "y"), second("x", "y")) == (1.0, 2.0)
    assert load_user_fn(f"{tmp_path}/a/../a/reward.py:score") is first  # one file, one module


def test_a_prompt_of_exactly_max_prompt_len_tokens_is_kept_and_one_more_is_dropped():
    from megatron_rl.data import build_char_tokenizer
    from megatron_rl.data.datasets import PromptDataset

    tok = build_char_tokenizer()
    limit = len(tok.encode("abcd"))
    records = [{"prompt": "abcd", "answer": 1}, {"prompt": "abcde", "answer": 2}, {"prompt": "abc", "answer": "x"}]
    ds = PromptDataset.from_records(records, tok, max_prompt_len=limit, apply_chat_template=False)
    assert [(p.prompt_text, p.answer, p.index) for p in ds] == [("abcd", "1", 0), ("abc", "x", 1)]
    assert ds.num_skipped == 1


def test_bootstrap_resamples_each_arm_at_its_own_size():
    from megatron_rl.telemetry.stats import bootstrap_diff_ci

    # a = [1] is constant; b = [0, 1] resampled twice has mean 0, 0.5, 1 with p = 1/4, 1/2, 1/4, so
    # the difference's median (level 0: both ends at the median) is 1 - 0.5. At size 1 it would be 0 or 1.
    assert bootstrap_diff_ci([1.0], [0.0, 1.0], resamples=4001, level=0.0, seed=1) == (0.5, 0.5, 0.5)
    # b = [0, 0, 0, 1] against a = [0]: the number of 1s in 4 draws is Binomial(4, 1/4), so a - b is
    # -1, -0.75, -0.5 with cumulative probability 0.004, 0.051, 0.262: the 15th percentile is -0.5
    # (with 1 draw: -1 with probability 0.25, so -1).
    assert bootstrap_diff_ci([0.0], [0.0, 0.0, 0.0, 1.0], resamples=4001, level=0.7, seed=2) == (-0.25, -0.5, 0.0)


def test_a_resume_follows_the_checkpoints_seed_and_shuffle_not_the_new_loaders():
    data = _dataset(10)
    run = PromptLoader(data, batch_size=3, seed=7)
    run.next_batch()
    state = run.state_dict()
    later = [run.next_batch() for _ in range(5)]  # crosses into epoch 1
    for seed, shuffle in ((8, True), (7, False)):  # a relaunch with another train.seed / shuffle
        resumed = PromptLoader(data, batch_size=3, seed=seed, shuffle=shuffle)
        resumed.load_state_dict(state)
        assert [resumed.next_batch() for _ in range(5)] == later
