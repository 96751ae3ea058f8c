"""The loop's orchestration: which log-probs feed each ratio and metric, which mini-batch calibrates
and when, what each phase hands the next, what the engine serves, and what a skipped step leaves
alone. Each test traces the real loop (loop_trace) and checks an invariant whose expected value is
worked out here from the recorded inputs, never by calling the loop's own code.

The main trace: 3 steps, calibration period 2 (steps 0 and 2 calibrate, step 1 does not), two
mini-batches per step, a learning rate high enough that the second mini-batch's ratios move well
outside [0.8, 1.2], and a clip controller started at (0.5, 1.6) with smoothing 0.5, so that the
bounds it holds stay far from the default ones and a loss clipping at the wrong pair shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.rewards import register_reward_fn
from megatron_rl.rewards.functions import position_match

sys.path.insert(0, str(Path(__file__).parent))
from loop_trace import check_sample_flow, trace_run  # noqa: E402

CONFIG = "fp8_calibrated.yaml"
PERIOD = 2
MAIN = ("train.num_steps=3", f"calib.period={PERIOD}", "train.lr=3e-3", "calib.smoothing=0.5")


def _wide_bounds(run_) -> None:
    state = run_.controller.state_dict()
    state.update(low=0.5, high=1.6)
    run_.controller.load_state_dict(state)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("orchestration")  # one warm-started tiny model for every trace


@pytest.fixture(scope="module")
def main_trace(root):
    return trace_run(root / "main", CONFIG, *MAIN, setup=_wide_bounds)


def _response(mb: dict) -> torch.Tensor:
    return mb["loss_mask"] > 0


def _first_update(step) -> int:
    return step.of("train")[0].updates


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "mxfp8"])
def test_first_mini_batch_ratio_is_exactly_one_at_theta_old(root, main_trace, recipe):
    """Old log-probs are the FP8 trainer's at theta_old, so the first mini-batch (trained before any
    update) sees r = 1 exactly under per-row / per-block recipes; BF16 or rollout old log-probs
    would give precision noise there, and the noise/* metrics must come from that mini-batch."""
    trace = main_trace if recipe == "blockwise" else trace_run(
        root / recipe, CONFIG, "train.num_steps=1", f"precision.train_recipe={recipe}", "train.lr=3e-3")
    for step in trace.steps:
        start = _first_update(step)
        at_old = [e for e in step.of("loss") if e.updates == start]
        assert at_old
        for e in at_old:
            on = _response(e.data["mb"])
            assert torch.equal(e.data["logprobs"][on], e.data["mb"]["old_logprobs"][on])
        m = step.metrics
        assert m["noise/log_ratio_std_at_old"] == 0.0 and m["noise/pg_clipfrac_at_old"] == 0.0
        assert not m["noise/clip_low_neg_at_old"] > 0  # NaN when that mini-batch has no A < 0 token
        assert m["log_ratio/std"] > 0.05  # later mini-batches did move: the check above is not vacuous


def test_old_logprobs_are_the_rollouts_when_configured(root):
    trace = trace_run(root / "rollout_old", CONFIG, "train.num_steps=1", "algo.use_rollout_logprobs=true",
                      "calib.enabled=false")
    (step,) = trace.steps
    for e in step.of("loss"):
        on = _response(e.data["mb"])
        assert torch.equal(e.data["mb"]["old_logprobs"][on], e.data["mb"]["rollout_logprobs"][on])
    assert step.metrics["mismatch/abs_logprob_diff"] == 0.0
    # no trainer recompute of the old log-probs: that forward is what the switch saves
    assert not [e for e in step.of("logprobs") if e.updates == _first_update(step)]


def test_mismatch_metrics_compare_old_with_rollout_logprobs(main_trace):
    """mismatch/* is trainer (theta_old) vs engine on every response token of the step, whatever
    the mini-batch's current log-probs are (they moved after the first update)."""
    for step in main_trace.steps:
        diffs = torch.cat([(e.data["mb"]["old_logprobs"].double() - e.data["mb"]["rollout_logprobs"].double())
                           [_response(e.data["mb"])] for e in step.of("loss")])
        assert step.metrics["mismatch/abs_logprob_diff"] == pytest.approx(float(diffs.abs().mean()), rel=1e-9)
        assert step.metrics["mismatch/token_mult_prob_error"] == pytest.approx(float(diffs.abs().exp().mean()), rel=1e-9)
        assert float(diffs.abs().max()) > 0  # FP8 rollout vs FP8 trainer: a real mismatch to measure


def test_calibration_batch_follows_an_update_and_shadow_is_at_theta_old(main_trace):
    """Calibrating at theta_old would compare BF16 with itself (spread exactly 0, nothing clipped):
    the calibration mini-batch must follow an update, and the BF16 shadow's old log-probs must be
    taken before the first update, on calibration steps only."""
    for index, step in enumerate(main_trace.steps):
        start = _first_update(step)
        bf16 = [e.updates for e in step.of("logprobs") if not e.data["fp8"]]
        if index % PERIOD:
            assert bf16 == [] and not [k for k in step.metrics if k.startswith("shadow/")]
            continue
        assert start in bf16 and max(bf16) > start, bf16  # shadow at theta_old, calibration after
        assert step.metrics["shadow/log_ratio_bf16_std"] > 1e-3
        assert step.metrics["shadow/log_ratio_fp8_std"] > 1e-3


def test_bounds_change_only_on_calibration_steps_and_feed_the_loss(main_trace):
    steps = main_trace.steps
    assert steps[0].state["controller"]["num_calibrations"] == 1, "step 0's calibration must succeed here"
    counts = [s.state["controller"]["num_calibrations"] + s.state["controller"]["num_skipped"] for s in steps]
    assert counts == [1, 1, 2]
    assert steps[1].state["controller"] == steps[0].state["controller"]  # held between calibrations
    low, high = steps[0].state["controller"]["low"], steps[0].state["controller"]["high"]
    assert (steps[1].metrics["calib/low"], steps[1].metrics["calib/high"]) == (low, high)
    # the loss of step 1 clipped at exactly those bounds, on the ratio of its own forward
    neg = pos = low_neg = high_pos = 0
    for e in steps[1].of("loss"):
        mb, on = e.data["mb"], _response(e.data["mb"])
        ratio = torch.exp(e.data["logprobs"][on] - mb["old_logprobs"][on])
        adv = mb["advantages"][on]
        neg, pos = neg + int((adv < 0).sum()), pos + int((adv > 0).sum())
        low_neg += int(((adv < 0) & (ratio < low)).sum())
        high_pos += int(((adv > 0) & (ratio > high)).sum())
    assert low_neg > 0
    assert steps[1].metrics["clip/low_neg"] == pytest.approx(low_neg / neg, abs=1e-12)
    assert steps[1].metrics["clip/high_pos"] == pytest.approx(high_pos / pos, abs=1e-12)


def test_each_step_rolls_out_one_new_batch_of_prompts(main_trace):
    seen = []
    for index, step in enumerate(main_trace.steps):
        (prompts,), (generate,) = step.of("prompts"), step.of("generate")
        assert generate.data["prompt_ids"] == prompts.data["prompt_ids"]  # one rank: the whole batch
        assert step.state["loader"]["position"] == (index + 1) * main_trace.cfg.data.prompts_per_step
        seen.append(prompts.data["prompt_ids"])
    assert all(a != b for a, b in zip(seen, seen[1:]))


def test_engine_samples_from_the_weights_of_the_previous_update(main_trace):
    """Version 1 is the start-up sync; every trained step publishes one more, after its update,
    and the next step's rollout is drawn from it. The engine holds the trainer's bytes exactly."""
    for index, step in enumerate(main_trace.steps):
        (generate,) = step.of("generate")
        assert generate.data["version"] == 1 + index
        assert step.state["engine_version"] == step.state["sync_version"] == 2 + index
        assert step.state["engine_sums"] == step.state["trainer_sums"]
    assert main_trace.steps[0].state["params"] != main_trace.initial["params"]


def test_trainer_gets_each_sample_once_with_its_own_reward_and_advantage(main_trace):
    """generate -> score -> advantages -> old log-probs -> train: every response the engine drew is
    trained exactly once per step, with the reward of its own prompt's answer and the GRPO
    advantage of its group, its tokens, mask and rollout log-probs as generated."""
    for step in main_trace.steps:
        check_sample_flow(main_trace, step)


def _half_constant_reward(response: str, answer: str) -> float:
    """0 for every response to a prompt whose answer starts with an even digit (a group dynamic
    sampling drops), partial credit otherwise (groups it keeps)."""
    return 0.0 if int(answer[0]) % 2 == 0 else position_match(response, answer)


def test_dynamic_sampling_trains_exactly_the_kept_groups(root):
    register_reward_fn("test_orchestration_half_constant", _half_constant_reward)
    trace = trace_run(root / "dynamic", CONFIG, "train.num_steps=2", "algo.dynamic_sampling=true",
                      "reward.name=test_orchestration_half_constant")
    kept = [s.metrics["dynamic_sampling/kept_frac"] for s in trace.steps]
    assert any(0 < k < 1 for k in kept), kept  # some groups dropped, some kept: not vacuous
    # refill: further rounds until prompts_per_step groups are kept, the first of them trained
    assert [s.metrics["dapo/kept_groups"] for s in trace.steps] == [trace.cfg.data.prompts_per_step] * 2
    assert any(s.metrics["dapo/gen_batches"] > 1 for s in trace.steps)
    for step in trace.steps:
        check_sample_flow(trace, step)


def _constant_reward(response: str, answer: str) -> float:
    return 0.5


def _nan_weight_after_startup_sync(run_) -> None:
    """The engine starts from good weights; then one trainer weight turns NaN, so every old
    log-prob is NaN and the guard must skip each step."""
    startup_sync = run_.sync.sync

    def sync():
        metrics = startup_sync()
        param = next(p for n, p in run_.actor.model[0].named_parameters() if "linear_fc2" in n)
        with torch.no_grad():
            param[0, 0] = float("nan")
        return metrics
    run_.sync.sync = sync


SKIP_CAUSES = {
    "all_groups_dropped": (("algo.dynamic_sampling=true", "algo.max_gen_batches=1",  # one round, no refill
                            "reward.name=test_orchestration_constant"), None),
    "nonfinite_old_logprobs": ((), _nan_weight_after_startup_sync),
}


@pytest.mark.parametrize("cause", SKIP_CAUSES)
def test_skipped_step_leaves_everything_untouched(root, cause):
    """No update, no sync (the engine keeps serving the start-up weights), the clip controller keeps
    its state even on a calibration step, and the prompts are consumed: the cursor moves one batch
    per step, as on a trained step. A dynamic-sampling skip needs no trainer forward at all."""
    register_reward_fn("test_orchestration_constant", _constant_reward)
    overrides, setup = SKIP_CAUSES[cause]
    trace = trace_run(root / cause, CONFIG, "train.num_steps=2", "calib.period=1", *overrides, setup=setup)
    before = trace.initial
    per_step = trace.cfg.data.prompts_per_step
    assert len({step.state["params"] for step in trace.steps}) == 1
    for index, step in enumerate(trace.steps):
        assert step.metrics["step/skipped"] == 1.0
        assert not [k for k in step.metrics if k.startswith(("sync/", "calib/", "shadow/")) or k == "pg_loss"]
        assert not step.of("train")
        if cause == "all_groups_dropped":
            assert [e.kind for e in step.events] == ["prompts", "generate", "score"]
            assert step.state["params"] == before["params"]
        else:
            assert step.metrics["guard/nonfinite_logprobs"] > 0
        s = step.state
        assert (s["optimizer"], s["controller"]) == (before["optimizer"], before["controller"])
        assert s["engine_version"] == s["sync_version"] == 1  # the start-up sync only
        assert s["engine_sums"] == before["trainer_sums"]
        assert s["loader"]["position"] == (index + 1) * per_step



def _vanilla_loss(e, old: torch.Tensor, denominator: float, low: float, high: float, tis_clip: float | None) -> float:
    """Slow reference of one micro-batch's loss: sum over response tokens of
    max(-A r, -A clip(r, L, H)) * min(exp(old - rollout), C) (weight 1 without TIS), over the
    mini-batch's token count."""
    mb, on = e.data["mb"], _response(e.data["mb"])
    lp, old, adv = e.data["logprobs"][on].double(), old[on].double(), mb["advantages"][on].double()
    ratio = torch.exp(lp - old)
    weight = 1.0 if tis_clip is None else torch.exp(old - mb["rollout_logprobs"][on].double()).clamp(max=tis_clip)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high)) * weight
    return float(per_token.sum()) / denominator


# With TIS the product r * w = exp(log pi - log pi_rollout) wherever neither clip binds, so forcing
# changes the loss only on clipped tokens; without TIS the recompute's noise shows on every token.
FORCED = {2: ("algo.use_tis=false",), 1: ()}


@pytest.mark.parametrize("mini_batches", sorted(FORCED))
def test_forced_on_policy_ratio_is_one_on_the_first_mini_batch_only(root, mini_batches):
    """algo.force_on_policy_ratio under per-tensor FP8 scaling (the recompute at theta_old is noisy):
    the first mini-batch of each step trains on r = 1 exactly (its TIS weights, if on, from its own
    forward); the next mini-batch, after an update, on the recomputed old log-probs. With one
    mini-batch the old-log-prob forward does not run at all."""
    trace = trace_run(root / f"forced_{mini_batches}", CONFIG, "train.num_steps=2", "calib.enabled=false",
                      "precision.train_recipe=tensorwise", "algo.force_on_policy_ratio=true", "train.lr=3e-3",
                      f"train.num_mini_batches={mini_batches}", *FORCED[mini_batches])
    a = trace.cfg.algo
    low, high, tis = 1.0 - a.eps_clip, 1.0 + a.eps_clip_high, a.tis_clip if a.use_tis else None
    noisy = later = 0
    for step in trace.steps:
        start = _first_update(step)
        totals = {e.updates: float(_response(e.data["batch"]).sum()) for e in step.of("train")}
        forwards = [e.updates for e in step.of("logprobs")]
        assert forwards == ([] if mini_batches == 1 else [start])  # the old forward, before any update
        for e in step.of("loss"):
            lp, den = e.data["logprobs"], totals[e.updates]
            if e.updates == start:
                assert e.data["loss"] == pytest.approx(_vanilla_loss(e, lp, den, low, high, tis), rel=1e-5)
                if "old_logprobs" in e.data["mb"]:  # the recompute's noise: forcing changed the loss
                    unforced = _vanilla_loss(e, e.data["mb"]["old_logprobs"], den, low, high, tis)
                    noisy += abs(unforced - e.data["loss"]) > 1e-4
            else:
                old = e.data["mb"]["old_logprobs"]
                assert e.data["loss"] == pytest.approx(_vanilla_loss(e, old, den, low, high, tis), rel=1e-5)
                later += 1
        assert step.metrics["noise/log_ratio_std_at_old"] == 0.0 and step.metrics["noise/pg_clipfrac_at_old"] == 0.0
    if mini_batches == 2:
        assert noisy == later == len(trace.steps)  # not vacuous: both kinds of mini-batch were checked
        assert trace.steps[-1].metrics["log_ratio/std"] > 0.01


def test_bf16_old_logprobs_feed_the_loss_and_cost_the_exact_ratio_at_theta_old(root):
    """algo.old_logprob_precision=bf16: the one old-log-prob pass runs on the BF16 path before any
    update, and the loss's ratio is FP8(theta) / BF16(theta_old): under blockwise FP8, whose own
    recompute is exact at theta_old, the first mini-batch now sees the FP8-vs-BF16 gap."""
    trace = trace_run(root / "bf16_old", CONFIG, "train.num_steps=1", "calib.enabled=false",
                      "algo.old_logprob_precision=bf16")
    (step,) = trace.steps
    start, a = _first_update(step), trace.cfg.algo
    assert [(e.updates, e.data["fp8"]) for e in step.of("logprobs")] == [(start, False)]
    for e in step.of("loss"):
        den = {t.updates: float(_response(t.data["batch"]).sum()) for t in step.of("train")}[e.updates]
        expected = _vanilla_loss(e, e.data["mb"]["old_logprobs"], den, 1 - a.eps_clip, 1 + a.eps_clip_high, a.tis_clip)
        assert e.data["loss"] == pytest.approx(expected, rel=1e-5)
    at_old = [e for e in step.of("loss") if e.updates == start]
    gap = torch.cat([(e.data["logprobs"] - e.data["mb"]["old_logprobs"])[_response(e.data["mb"])] for e in at_old])
    assert float(gap.abs().max()) > 1e-3 and step.metrics["noise/log_ratio_std_at_old"] > 1e-4
