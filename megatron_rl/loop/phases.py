"""The three phases of one RL step: generate + score, prepare old log-probs, PPO updates."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from megatron_rl import collectives
from megatron_rl.actor.packing import pack_batch, pad_multiple, per_sequence, unpack
from megatron_rl.data.tasks import get_task
from megatron_rl.loop.batch import Batch, collate, mini_batches

log = logging.getLogger("megatron_rl.loop.phases")


@dataclass
class Rollout:
    batch: Batch | None  # None when dynamic sampling dropped every group
    metrics: dict[str, float]


def _step_seed(seed: int, step: int, salt: int) -> int:
    """Per-step seeds: a resumed run draws exactly what an uninterrupted one would."""
    return (seed * 1_000_003 + step * 7_919 + salt * 104_729) % (2**31 - 1)


def _shard(prompts: list, parallel) -> list:
    per_rank = len(prompts) // parallel.dp_size
    return prompts[parallel.dp_rank * per_rank: (parallel.dp_rank + 1) * per_rank]


def _generate_on_engine(run, prompts, step: int):
    from megatron_rl.rollout.base import SamplingParams

    r = run.cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                              stop_token_ids=[run.tokenizer.eos_token_id], n=r.n_samples_per_prompt,
                              seed=_step_seed(run.cfg.train.seed, step, run.parallel.dp_rank))
    return run.engine.generate([p.prompt_ids for p in prompts], sampling)


def _score(run, prompts, samples) -> tuple[torch.Tensor, dict[str, float], torch.Tensor | None]:
    """Rewards [N] (+ DAPO overlong shaping), reward-runner error counts, and garbled [N] float32
    (1.0 where a response fails the built-in task's format check; None for a user dataset)."""
    from megatron_rl.algo.advantages import overlong_penalty

    n = run.cfg.rollout.n_samples_per_prompt
    texts = run.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    answers = [prompts[i // n].answer for i in range(len(samples))]
    rewards, stats = run.rewards.score(texts, answers)
    rewards = torch.tensor(rewards, dtype=torch.float32)  # non-finite results: 0 and counted as errors
    a = run.cfg.algo
    if a.overlong_buffer_len > 0:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        rewards = rewards + overlong_penalty(lengths, run.cfg.rollout.max_new_tokens,
                                             a.overlong_buffer_len, a.overlong_penalty_factor)
    valid = None if run.cfg.data.path else get_task(run.cfg.data.task).valid_format
    garbled = None if valid is None else torch.tensor([float(not valid(t)) for t in texts])
    return rewards, {"reward/errors": float(stats["num_errors"]),
                     "reward/timeouts": float(stats["num_timeouts"])}, garbled


def _advantages(run, rewards: torch.Tensor) -> torch.Tensor:
    from megatron_rl.algo.advantages import grpo_advantages

    est = run.cfg.algo.advantage_estimator
    return grpo_advantages(rewards, run.cfg.rollout.n_samples_per_prompt,
                           norm_by_std=est == "grpo", leave_one_out=est == "rloo")


def generate(run, prompts, step: int) -> Rollout:
    """Engine rank samples; its model-parallel peers receive the samples by broadcast."""
    from megatron_rl.algo.advantages import dynamic_sampling_keep

    t0 = time.perf_counter()
    prompts = _shard(prompts, run.parallel)
    samples = _generate_on_engine(run, prompts, step) if run.is_engine_rank else None
    samples = _broadcast_from_engine_rank(samples, run.parallel, run.host_groups)
    if run.host_groups is not None:  # replicas finish their rollouts apart: wait here (gloo), not in
        collectives.barrier(run.host_groups.dp)  # the next NCCL data-parallel reduction
    t_rollout = time.perf_counter() - t0
    rewards, metrics, garbled = _score_on_engine_rank(run, prompts, samples)
    n = run.cfg.rollout.n_samples_per_prompt
    keep = dynamic_sampling_keep(rewards, n) if run.cfg.algo.dynamic_sampling else torch.ones_like(rewards, dtype=torch.bool)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    means = {"reward/mean": rewards, "reward/sq": rewards**2, "response_length/mean": lengths,
             "dynamic_sampling/kept_frac": keep.float()}
    if garbled is not None:  # every response of every DP rank, before dynamic sampling drops any
        means["health/garbled_rate"] = garbled
    metrics.update(_reduced_means(run, means))
    metrics["reward/std"] = max(metrics.pop("reward/sq") - metrics["reward/mean"] ** 2, 0.0) ** 0.5
    metrics["time/rollout"] = t_rollout
    kept_total = _reduce_sum(run, float(keep.sum()))
    if kept_total == 0:
        metrics["step/skipped"] = 1.0
        return Rollout(None, metrics)
    advantages = _advantages(run, rewards)
    batch = collate(samples, advantages, run.tokenizer.pad_token_id)
    metrics["step/skipped"] = 0.0
    return Rollout(_drop_groups(batch, keep, run.parallel.dp_size), metrics)


def _drop_groups(batch: Batch, keep: torch.Tensor, dp_size: int) -> Batch:
    """DAPO dynamic sampling. One rank: drop the rows. Several DP ranks: zero the dropped rows'
    loss mask instead, so every rank keeps a non-empty batch for the collectives while the loss,
    its denominator and the metrics see exactly the kept rows."""
    if bool(keep.all()):
        return batch
    if dp_size == 1:
        return {k: v[keep] for k, v in batch.items()}
    batch["loss_mask"] = batch["loss_mask"] * keep[:, None]
    batch["advantages"] = batch["advantages"] * keep[:, None]
    return batch


def _score_on_engine_rank(run, prompts, samples) -> tuple[torch.Tensor, dict[str, float], torch.Tensor | None]:
    """Rewards are scored once per model replica and broadcast: scoring on every TP x PP rank
    under a wall-clock timeout could give the ranks different advantages, hence different (L, H)
    and losses inside one replica."""
    scored = _score(run, prompts, samples) if run.is_engine_rank else None
    return _broadcast_from_engine_rank(scored, run.parallel, run.host_groups)


def _broadcast_from_engine_rank(samples, parallel, host_groups=None):
    """Samples from the first rank of the model-parallel group to the group's other ranks.

    The other ranks wait here for a whole rollout (a 16-20K-token tail can pass NCCL's 30-minute
    watchdog), so the wait runs on the gloo twin of the model-parallel group when there is one."""
    if parallel.tp_size * parallel.pp_size == 1:
        return samples
    mp_host = host_groups.mp if host_groups is not None else None
    group = mp_host if mp_host is not None else parallel.mp_group  # TP x PP ranks of this replica
    return collectives.broadcast_object(samples, collectives.global_rank(group, 0), group)


def pad_rows(batch: Batch, multiple: int) -> tuple[Batch, int]:
    """Append fully masked rows so the row count is a multiple of `multiple` (the actor needs
    equal micro-batches: pipeline stages exchange fixed shapes). Padding rows have loss_mask 0,
    so they add nothing to the loss, its denominator or any metric. Returns (batch, real rows)."""
    rows = batch["tokens"].shape[0]
    extra = -rows % multiple
    if extra == 0:
        return batch, rows
    return {k: torch.cat([v, v[:1].expand(extra, *v.shape[1:]) * 0]) for k, v in batch.items()}, rows


def pad_columns(batch: Batch, multiple: int) -> Batch:
    """Append masked positions to every [B, S] tensor so S is a multiple of `multiple` (sequence
    parallel splits the sequence over the TP ranks). Padding has loss_mask 0; attention is causal,
    so earlier positions' outputs do not change."""
    width = batch["tokens"].shape[1]
    extra = -width % multiple
    if extra == 0:
        return batch
    return {k: torch.nn.functional.pad(v, (0, extra)) if v.dim() == 2 and v.shape[1] == width else v
            for k, v in batch.items()}


def _actor_batch(run, batch: Batch):
    """(actor batch, micro_batch_size, restore): sequences packed to the token budget, one packed
    row per micro-batch (train.max_tokens_per_micro_batch > 0), or rows padded to micro_batch_size
    (and columns to the TP size under sequence parallel); restore maps the actor's per-token
    outputs back to `batch`'s [B, S] layout."""
    t = run.cfg.train
    sp = bool(run.actor.config.sequence_parallel)
    if t.max_tokens_per_micro_batch == 0:
        rows, cols = batch["tokens"].shape
        padded, _ = pad_rows(pad_columns(batch, run.parallel.tp_size if sp else 1), t.micro_batch_size)
        return padded, t.micro_batch_size, lambda values: values[:rows, :cols]
    multiple = pad_multiple(run.cfg.precision.train_recipe, run.parallel.tp_size, sp)
    packed, index = pack_batch(batch, t.max_tokens_per_micro_batch, multiple)
    return packed, 1, lambda values: unpack(values, index)


def _logprobs(run, batch: Batch, fp8: bool = True) -> torch.Tensor:
    actor_batch, mbs, restore = _actor_batch(run, batch)
    out = run.actor.compute_logprobs(actor_batch, micro_batch_size=mbs, with_entropy=False, fp8=fp8,
                                     logprob_chunk_size=run.cfg.train.logprob_chunk_size)
    return restore(out["logprobs"])


def _old_logprobs(run, batch: Batch) -> torch.Tensor:
    """The trainer's old log-probs; with calibrated FP8 KV scales the same forward records K/V amax."""
    calibration = getattr(run, "kv_calibration", None)
    if calibration is None:
        return _logprobs(run, batch)
    with calibration.recording(run.actor.model):
        return _logprobs(run, batch)


def _reduce_sum(run, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    return float(run.parallel.dp_reducer()(t)[0])


def _reduced_means(run, named: dict[str, torch.Tensor]) -> dict[str, float]:
    """Means over the global batch: sums and counts all-reduced over DP in one call."""
    stacked = torch.tensor([[float(v.sum()), float(v.numel())] for v in named.values()], dtype=torch.float64)
    stacked = run.parallel.dp_reducer()(stacked)
    return {k: float(s / max(c, 1.0)) for k, (s, c) in zip(named, stacked.tolist())}


def prepare(run, batch: Batch | None, step: int, metrics: dict[str, float]) -> Batch | None:
    """Old log-probs (trainer recompute in the FP8 recipe, or the rollout's). The BF16 shadow's
    old log-probs are computed in update_policy, on the calibration rows only.

    Returns None (the step is skipped: no update, no sync) when there is nothing to train on or
    when any old log-prob on a response token is NaN/Inf: never a silent wrong update.
    """
    if batch is None:
        return None
    t0 = time.perf_counter()
    if run.cfg.algo.use_rollout_logprobs:
        batch["old_logprobs"] = batch["rollout_logprobs"].clone()
    else:
        batch["old_logprobs"] = _old_logprobs(run, batch)
    metrics["time/old_logprobs"] = time.perf_counter() - t0
    bad = _count_nonfinite(run, batch)
    metrics["guard/nonfinite_logprobs"] = bad
    if bad:
        log.warning("step %d: %d non-finite old log-probs on response tokens: step skipped", step, int(bad))
        metrics["step/skipped"] = 1.0
        return None
    return batch


def _count_nonfinite(run, batch: Batch) -> float:
    on = batch["loss_mask"] > 0
    bad = sum((~torch.isfinite(batch[k]) & on).sum() for k in ("old_logprobs", "old_logprobs_ref") if k in batch)
    return _reduce_sum(run, float(bad))


def _shadow_step(run, step: int) -> bool:
    c = run.cfg.calib
    return (c.enabled or c.diagnose) and run.controller.should_calibrate(step)


def _bounds(run) -> tuple[float, float]:
    a = run.cfg.algo
    return run.controller.bounds if run.cfg.calib.enabled else (1.0 - a.eps_clip, 1.0 + a.eps_clip_high)


# Metrics of the calibration mini-batch, where FP8 and the BF16 shadow see the same tokens.
SHADOW_KEYS = {
    "clip/low_neg": "shadow/clip_low_neg_fp8", "clip/low_neg_ref": "shadow/clip_low_neg_bf16",
    "clip/high_pos": "shadow/clip_high_pos_fp8", "clip/high_pos_ref": "shadow/clip_high_pos_bf16",
    "false_clip/low_neg": "shadow/false_clip_low_neg", "missed_clip/low_neg": "shadow/missed_clip_low_neg",
    "false_clip/share": "shadow/false_clip_share", "log_ratio/std": "shadow/log_ratio_fp8_std",
    "log_ratio_ref/std": "shadow/log_ratio_bf16_std",
    "false_clip/high_pos": "shadow/false_clip_high_pos", "missed_clip/high_pos": "shadow/missed_clip_high_pos",
}
# Metrics of the first mini-batch, trained at theta_old: any ratio spread there is precision noise.
NOISE_KEYS = {"log_ratio/std": "noise/log_ratio_std_at_old", "clip/low_neg": "noise/clip_low_neg_at_old",
              "pg_clipfrac": "noise/pg_clipfrac_at_old"}
# What calibration would set, logged by runs that only diagnose (calibration off).
DIAGNOSE_KEYS = {"calib/alpha": "diag/alpha", "calib/low_raw": "diag/low", "calib/high_raw": "diag/high",
                 "calib/balance_bf16": "diag/balance_bf16", "calib/balance_fp8_default": "diag/balance_fp8"}


def _renamed(metrics: dict[str, float], names: dict[str, str]) -> dict[str, float]:
    return {new: metrics[old] for old, new in names.items() if old in metrics}


# Loss-metric key carrying the calibration histogram of one micro-batch (popped before reducing).
HIST_KEY = "calib/_histogram"


def _shadow_old(run, mb: Batch) -> None:
    """Extra forward #1 (paper.md 1.4): BF16 at theta_old, on the calibration rows only. With the
    rollout's log-probs as old log-probs, both ratios share that denominator and no pass is needed."""
    mb["old_logprobs_ref"] = mb["old_logprobs"] if run.cfg.algo.use_rollout_logprobs else _logprobs(run, mb, fp8=False)


def _shadow_ratio(run, mb: Batch) -> None:
    """Extra forward #2: BF16 at the current weights, so the loss can report false clips on these
    tokens and the histogram can pair each FP8 ratio with its BF16 twin."""
    mb["ratio_ref"] = torch.exp((_logprobs(run, mb, fp8=False) - mb["old_logprobs_ref"]) * mb["loss_mask"])


def _histogram_payload(run, logprobs: torch.Tensor, mb: Batch) -> torch.Tensor:
    """This micro-batch's calibration histogram: the FP8 ratio of the training forward itself,
    every token weighted as the loss weighs it (TIS / IcePop, aggregation, dual-clip)."""
    from megatron_rl.algo.policy_loss import LOG_RATIO_CLAMP, loss_token_weights

    a = run.cfg.algo
    mask, old = mb["loss_mask"].cpu(), mb["old_logprobs"].cpu()
    log_ratio = ((logprobs.detach().float().cpu() - old) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weights = loss_token_weights(mask, a.loss_agg_mode, old, mb["rollout_logprobs"].cpu(), a.use_tis,
                                 mode=a.tis_mode, tis_clip=a.tis_clip, tis_clip_low=a.tis_clip_low,
                                 icepop_low=a.icepop_low, icepop_high=a.icepop_high)
    hist = run.controller.new_histogram()
    hist.add(log_ratio.exp(), mb["ratio_ref"].cpu(), mb["advantages"].cpu(), mask, weights=weights,
             dual_clip=a.eps_clip_c)
    return hist.payload


def _calibrate(run, metric_dicts: list[dict], step: int) -> dict[str, float]:
    """New (L, H) from the calibration mini-batch's histograms (popped from its loss metrics).

    Without calibration (diagnose only) the controller still runs, but its bounds are not applied.
    """
    hist = run.controller.new_histogram()
    for m in metric_dicts:
        hist.merge(m.pop(HIST_KEY))
    out = run.controller.update_from_histogram(hist, reduce=run.parallel.dp_reducer(), step=step)
    assert_same_across_model_parallel(run.controller.bounds, run.parallel)
    _log_calibration(run, out, step)
    if run.cfg.calib.dump_dir and run.is_log_rank:
        _dump_histogram(run, hist, step)
    return out if run.cfg.calib.enabled else _renamed(out, DIAGNOSE_KEYS)


def assert_same_across_model_parallel(bounds: tuple[float, float], parallel) -> None:
    """(L, H) must be bitwise identical on every TP x PP rank of a replica (RuntimeError if not)."""
    if parallel.tp_size * parallel.pp_size == 1:
        return
    everyone = collectives.all_gather_objects(tuple(bounds), parallel.mp_group)
    if any(b != everyone[0] for b in everyone):
        raise RuntimeError(f"calibrated (L, H) differ across the model-parallel group: {everyone}")


def _log_calibration(run, out: dict[str, float], step: int) -> None:
    if out["calib/skipped"]:
        reason = next(k for k in out if k.startswith("calib/skipped_") and out[k])
        log.warning("step %d: calibration skipped (%s); bounds kept, retried next step", step, reason)
        return
    kept = [k for k in ("calib/high_unattainable", "calib/high_edge", "calib/high_no_bf16_upper_clip",
                        "calib/high_undefined", "calib/low_edge") if out.get(k)]
    if kept:
        log.info("step %d: previous bound kept (%s)", step, ", ".join(k.split("/")[1] for k in kept))


def _dump_histogram(run, hist, step: int) -> None:
    from pathlib import Path

    path = Path(run.cfg.calib.dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "payload": hist.payload, "eps_low": hist.eps_low, "eps_high": hist.eps_high,
                "num_bins": hist.num_bins, "log_ratio_range": hist.log_ratio_range,
                "bounds": run.controller.bounds}, path / f"calib_{step:06d}.pt")


def _loss_fn(run, denominator: float, bounds: tuple[float, float], calibrating: bool = False):
    from megatron_rl.algo.policy_loss import policy_loss

    a = run.cfg.algo

    def loss_fn(logprobs, entropy, mb):
        logprobs, entropy, mb = per_sequence(logprobs, entropy, mb)  # packed: seq-mean stays exact
        loss, metrics = policy_loss(
            logprobs, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], denominator=denominator,
            clip_low=bounds[0], clip_high=bounds[1], eps_clip_c=a.eps_clip_c, loss_agg_mode=a.loss_agg_mode,
            rollout_logprobs=mb["rollout_logprobs"], use_tis=a.use_tis, tis_clip=a.tis_clip,
            tis_clip_low=a.tis_clip_low, tis_mode=a.tis_mode, icepop_low=a.icepop_low,
            icepop_high=a.icepop_high, kl_loss_type=a.kl_loss_type, kl_loss_coef=a.kl_loss_coef,
            entropy=entropy, entropy_coef=a.entropy_coef, ratio_ref=mb.get("ratio_ref"),
            ref_clip_low=1.0 - a.eps_clip, ref_clip_high=1.0 + a.eps_clip_high)
        if calibrating:
            metrics[HIST_KEY] = _histogram_payload(run, logprobs, mb)
        return loss, metrics
    return loss_fn


def update_policy(run, batch: Batch, step: int) -> dict[str, float]:
    """PPO epochs over shuffled mini-batches; on shadow steps the last mini-batch calibrates.

    The calibration mini-batch trains with the bounds in force, and its own training forward
    provides the FP8 ratio; the new (L, H) apply from the next step. Its BF16 theta_old pass runs
    before the first update (the splits are drawn up front, the same draws as one by one)."""
    from megatron_rl.algo.metrics import reduce_metrics
    from megatron_rl.algo.policy_loss import loss_denominator

    t0 = time.perf_counter()
    cfg, reduce = run.cfg, run.parallel.dp_reducer()
    gen = torch.Generator().manual_seed(_step_seed(cfg.train.seed, step, 7))
    loss_metrics, out = [], {}
    grad_norms, skipped_updates = [], 0
    plan = [mini_batches(batch, cfg.train.num_mini_batches, gen) for _ in range(cfg.train.ppo_epochs)]
    if _shadow_step(run, step):
        _shadow_old(run, plan[-1][-1])
    for epoch, parts in enumerate(plan):
        for i, mb in enumerate(parts):
            calibrating = "old_logprobs_ref" in mb
            if calibrating:
                _shadow_ratio(run, mb)
            denominator = loss_denominator(mb["loss_mask"], cfg.algo.loss_agg_mode, reduce=reduce)
            actor_mb, mbs, _ = _actor_batch(run, mb)
            result = run.actor.train_step(actor_mb, _loss_fn(run, denominator, _bounds(run), calibrating),
                                          micro_batch_size=mbs,
                                          logprob_chunk_size=cfg.train.logprob_chunk_size)
            if calibrating:
                out.update(_calibrate(run, result["metrics"], step))
            loss_metrics.extend(result["metrics"])
            grad_norms.append(result["grad_norm"])
            skipped_updates += int(result["skipped"])
            if epoch == 0 and i == 0:
                out.update(_renamed(reduce_metrics(result["metrics"], reduce=reduce), NOISE_KEYS))
            if calibrating:
                out.update(_renamed(reduce_metrics(result["metrics"], reduce=reduce), SHADOW_KEYS))
    out.update(reduce_metrics(loss_metrics, reduce=reduce))
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["guard/skipped_updates"] = float(skipped_updates)  # non-finite gradients: no update
    out["calib/low"], out["calib/high"] = _bounds(run)
    out["calib/high_unbounded"] = float(math.isinf(out["calib/high"]))  # JSON logs inf as null
    out["time/train"] = time.perf_counter() - t0
    return out
