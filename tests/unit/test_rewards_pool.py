"""The reward worker pool: samples scored concurrently by reward.num_workers processes (shown by a
barrier that only that many concurrent calls can pass, not by timing), a timeout or a death failing
only its own item while the rest of its chunk is scored elsewhere, a batched reward kept whole, and
the prompt among the reward's keyword arguments."""

import multiprocessing as mp
import os
import time

import pytest

from megatron_rl.data.datasets import PromptItem
from megatron_rl.loop.sampling import score_texts
from megatron_rl.rewards import RewardRunner
from megatron_rl.rewards.runner import _chunks

BARRIER = mp.get_context("fork").Barrier(3, timeout=20.0)  # forked workers share it


def meet(response, answer):
    """Passes only when three calls wait at once (threading.BrokenBarrierError otherwise)."""
    BARRIER.wait()
    return 1.0


def test_three_workers_score_three_samples_at_once():
    BARRIER.reset()
    with RewardRunner(meet, timeout_s=60.0, num_workers=3) as runner:
        assert runner.score(["a", "b", "c"], ["a", "b", "c"]) == ([1.0] * 3, {"num_errors": 0, "num_timeouts": 0})
        assert len({w.proc.pid for w in runner.workers}) == 3


def test_one_worker_scores_one_sample_at_a_time():
    short = mp.get_context("fork").Barrier(2, timeout=1.0)

    def meet_two(response, answer):
        short.wait()
        return 1.0

    with RewardRunner(meet_two, timeout_s=60.0, num_workers=1) as runner:
        rewards, stats = runner.score(["a", "b"], ["a", "b"])
    assert rewards == [0.0, 0.0] and stats["num_errors"] == 2  # each waited alone and broke the barrier


def picky(response, answer):
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os._exit(3)
    return 1.0 if response == answer else 0.25


def test_a_hang_or_a_death_fails_its_item_and_the_rest_of_its_chunk_is_scored():
    responses = ["a", "b", "hang", "c", "d", "die", "e", "f"] * 2
    answers = ["a", "x", "x", "c", "x", "x", "e", "x"] * 2
    with RewardRunner(picky, timeout_s=2.0, num_workers=2) as runner:
        assert _chunks(16, 2, False)[1] == [2, 3]  # chunks of two: each hang and death has a neighbour behind it
        rewards, stats = runner.score(responses, answers)
        assert rewards == [1.0, 0.25, 0.0, 1.0, 0.25, 0.0, 1.0, 0.25] * 2
        assert (stats["num_timeouts"], stats["num_errors"]) == (2, 2)
        assert runner.num_restarts == 4
        assert runner.score(["q"], ["q"])[0] == [1.0]  # the restarted workers keep serving


def test_chunks_cover_every_item_once_in_order():
    for count in (0, 1, 7, 16, 72, 1000):
        for workers in (1, 3, 8):
            for batched in (False, True):
                chunks = _chunks(count, workers, batched)
                assert [i for c in chunks for i in c] == list(range(count))
                assert len(chunks) <= (1 if batched or workers == 1 else 4 * workers)
    assert _chunks(10, 1, False) == [list(range(10))]  # one worker: one message, as before the pool


def sizes(responses, answers):
    """Each item scores the size of the call it came in; 'raise' fails its call."""
    if "raise" in responses:
        raise RuntimeError("grader down")
    return [float(len(responses))] * len(responses)


def test_a_batched_reward_still_sees_the_whole_batch_in_one_call():
    """A batched function may score relative to the batch (a group baseline): the pool never splits it."""
    with RewardRunner(sizes, timeout_s=60.0, batched=True, num_workers=3) as runner:
        assert runner.score(list("abcdefg"), list("abcdefg"))[0] == [7.0] * 7
        rewards, stats = runner.score(["a", "b", "raise", "c"], list("abcd"))
        assert rewards == [0.0] * 4 and stats["num_errors"] == 4


def with_prompt(response, answer, prompt, level=None):
    return {"score": float(level == "hard"), "pred": f"{prompt}>{response}"}


def old_style(response, answer):
    return float(response == answer)


def everything(response, answer, **extra):
    return {"score": 0.0, "pred": ",".join(sorted(extra))}


def test_the_prompt_reaches_a_reward_that_names_it_and_old_signatures_still_work():
    prompts = [PromptItem([1], "Q0?", "a", 0, {"level": "hard"}), PromptItem([2], "Q1?", "b", 1, {"prompt": "raw"})]
    texts = ["a", "x", "b", "b"]  # two samples per prompt
    with RewardRunner(with_prompt, num_workers=2) as runner:
        rewards, stats = score_texts(runner, prompts, texts, n=2)
        assert rewards == [1.0, 1.0, 0.0, 0.0]
        assert stats["preds"] == ["Q0?>a", "Q0?>x", "Q1?>b", "Q1?>b"]  # the prompt text, over a column of that name
    with RewardRunner(old_style) as runner:
        assert score_texts(runner, prompts, texts, n=2)[0] == [1.0, 0.0, 1.0, 1.0]
    with RewardRunner(everything) as runner:
        assert score_texts(runner, prompts, texts, n=2)[1]["preds"] == ["level,prompt"] * 2 + ["prompt"] * 2


def test_bad_pool_size():
    with pytest.raises(ValueError, match="^num_workers must be >= 1, got 0$"):
        RewardRunner(old_style, num_workers=0)
    from megatron_rl.config import load_config

    with pytest.raises(ValueError, match="config key 'reward.num_workers': must be >= 1, got 0"):
        load_config(None, ["reward.num_workers=0"])
    assert load_config(None, []).reward.num_workers == 4
