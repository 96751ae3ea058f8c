"""User rewards by import path: per-sample with components and pred, batched, raising and hanging ones
contained; resolution and signature checks at config load."""

import sys
import textwrap
import time

import pytest

from megatron_rl.config import load_config
from megatron_rl.rewards import RewardRunner, get_reward_fn

USER_CODE = textwrap.dedent('''
    import time

    def scored(response, answer, level=None):
        """A dict: score, two components and the extracted answer."""
        right = float(response.strip() == answer)
        return {"score": right + 0.5 * (level == "hard"), "format": 1.0, "correct": right,
                "pred": response.strip(), "note": "ignored: not a number"}

    def takes_all(response, answer, **extra):
        return float(len(extra))

    def batched(responses, answers, level=None):
        return [float(r == a) * (2.0 if lv == "hard" else 1.0) for r, a, lv in zip(responses, answers, level)]

    def batched_raises(responses, answers):
        raise RuntimeError("grader down")

    def batched_short(responses, answers):
        return [1.0]

    def picky(response, answer):
        if response == "raise":
            raise KeyError("boom")
        if response == "hang":
            time.sleep(60)
        if response == "nodict":
            return {"correct": 1.0}
        return 1.0

    def one_arg(response):
        return 0.0
''')


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    return path


@pytest.fixture()
def reward_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg_site" / "user_pkg_for_rewards"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg_site"))
    yield "user_pkg_for_rewards.scores"
    for name in [m for m in sys.modules if m.startswith("user_pkg_for_rewards")]:
        del sys.modules[name]


def test_file_reward_per_sample_with_components_and_extra(reward_file):
    fn = get_reward_fn(f"{reward_file}:scored")
    with RewardRunner(fn, timeout_s=60.0) as runner:
        rewards, stats = runner.score(["42", "41", " 7 "], ["42", "42", "7"],
                                      extras=[{"level": "hard", "source": "x"}, {"level": "easy"}, {}])
    assert rewards == [1.5, 0.0, 1.0]
    assert stats["num_errors"] == 0 and stats["num_timeouts"] == 0
    assert stats["components"] == {"correct": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 1.0]}
    assert stats["preds"] == ["42", "41", "7"]


def test_module_reward_gets_every_extra_with_kwargs(reward_pkg):
    fn = get_reward_fn(f"{reward_pkg}:takes_all")
    with RewardRunner(fn, timeout_s=60.0) as runner:
        rewards, stats = runner.score(["a", "b"], ["a", "b"], extras=[{"x": 1, "y": 2}, {"x": 3}])
    assert rewards == [2.0, 1.0] and "components" not in stats and "preds" not in stats


def test_module_reward_batched(reward_pkg):
    fn = get_reward_fn(f"{reward_pkg}:batched", batched=True)
    with RewardRunner(fn, timeout_s=60.0, batched=True) as runner:
        rewards, stats = runner.score(["1", "2", "3"], ["1", "2", "0"],
                                      extras=[{"level": "hard"}, {"level": "easy"}, {"level": "hard"}])
    assert rewards == [2.0, 1.0, 0.0] and stats == {"num_errors": 0, "num_timeouts": 0}


def test_batched_failures_score_the_batch_zero(reward_file):
    for name, reason in (("batched_raises", "grader down"), ("batched_short", "length 1 for 2 samples")):
        with RewardRunner(get_reward_fn(f"{reward_file}:{name}", batched=True), timeout_s=60.0, batched=True) as runner:
            rewards, stats = runner.score(["a", "b"], ["a", "b"])
        assert rewards == [0.0, 0.0] and stats == {"num_errors": 2, "num_timeouts": 0}, (name, reason)


def test_raising_hanging_and_malformed_user_rewards_are_contained(reward_file, caplog):
    fn = get_reward_fn(f"{reward_file}:picky")
    with RewardRunner(fn, timeout_s=3.0) as runner:
        start = time.monotonic()
        rewards, stats = runner.score(["ok", "raise", "hang", "nodict", "ok"], ["x"] * 5)
        assert time.monotonic() - start < 30.0
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert stats == {"num_errors": 2, "num_timeouts": 1}
    assert "reward dict without 'score'" in caplog.text


def test_config_resolves_and_checks_at_load(reward_file, reward_pkg):
    assert load_config(None, [f"reward.name={reward_file}:scored"]).reward.name.endswith(":scored")
    load_config(None, [f"reward.name={reward_pkg}:batched", "reward.batched=true"])
    cases = [
        ("reward.name=math_verfy", "unknown reward function 'math_verfy'"),
        (f"reward.name={reward_file}:nope", "has no attribute 'nope'"),
        (f"reward.name={reward_file.parent}/missing.py:f", "no such file"),
        ("reward.name=no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        (f"reward.name={reward_file}:one_arg", "takes \\(response, answer"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=f"config key 'reward.name': .*{message}"):
            load_config(None, [override])
    with pytest.raises(ValueError, match="config key 'reward.name': .*batched needs an import path"):
        load_config(None, ["reward.name=exact_match", "reward.batched=true"])


def test_component_names_never_overwrite_the_loops_metrics():
    from megatron_rl.loop.phases import _component_key

    assert [_component_key(n) for n in ("format", "mean", "errors", "std")] == [
        "reward/format", "reward/fn_mean", "reward/fn_errors", "reward/fn_std"]
