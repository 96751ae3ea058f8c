"""The three phases of one RL step: generate + score, prepare old log-probs, PPO updates."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch

from megatron_rl import collectives
from megatron_rl.actor.packing import pack_batch, pad_multiple, per_sequence, unpack
from megatron_rl.data.tasks import get_task
from megatron_rl.loop.batch import Batch, collate, mini_batches
from megatron_rl.loop.sampling import response_texts, sampling_params, score_texts

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


def _generate_on_engine(run, prompts, step: int, salt: int):
    r = run.cfg.rollout
    seed = run.cfg.train.seed if r.seed is None else r.seed
    sampling = sampling_params(r, run.tokenizer.eos_token_id, n=r.n_samples_per_prompt,
                               seed=_step_seed(seed, step, salt))
    return run.engine.generate([p.prompt_ids for p in prompts], sampling)


def _score(run, prompts, samples) -> tuple[torch.Tensor, dict[str, float], torch.Tensor | None]:
    """Task rewards [N] (unshaped: the overlong shaping is `_overlong`'s), reward-runner error counts,
    and garbled [N] float32 (1.0 where a response fails the built-in task's format check; None for a
    user dataset). The reward's named components ride in the metrics as "reward/<name>" -> [N]
    float32 lists (`generate` averages them over the global batch)."""
    texts = response_texts(run.tokenizer, samples, run.cfg.rollout.stop)
    rewards, stats = score_texts(run.rewards, prompts, texts, run.cfg.rollout.n_samples_per_prompt)
    rewards = torch.tensor(rewards, dtype=torch.float32)  # non-finite results: 0 and counted as errors
    valid = None if run.cfg.data.path else get_task(run.cfg.data.task).valid_format
    garbled = None if valid is None else torch.tensor([float(not valid(t)) for t in texts])
    metrics = {"reward/errors": float(stats["num_errors"]), "reward/timeouts": float(stats["num_timeouts"])}
    metrics.update({_component_key(k): v for k, v in stats.get("components", {}).items()})
    return rewards, metrics, garbled


# The loop's own reward/* metrics: a reward component of the same name is logged as reward/fn_<name>.
RESERVED_REWARD_KEYS = ("mean", "std", "sq", "errors", "timeouts", "accuracy", "overlong_penalty")


def _overlong(run, samples) -> torch.Tensor:
    """DAPO overlong shaping [N] float32 (<= 0; zeros when off), from the response lengths alone."""
    from megatron_rl.algo.advantages import overlong_penalty

    a, lengths = run.cfg.algo, torch.tensor([len(s.response_ids) for s in samples])
    if a.overlong_buffer_len == 0:
        return torch.zeros(len(samples))
    return overlong_penalty(lengths, run.cfg.rollout.max_new_tokens, a.overlong_buffer_len,
                            a.overlong_penalty_factor).float()


def _component_key(name: str) -> str:
    return f"reward/fn_{name}" if name in RESERVED_REWARD_KEYS else f"reward/{name}"


def _length_metrics(run, samples) -> tuple[dict[str, torch.Tensor], float]:
    """Per-sample means (length, truncated fraction) and the global maximum response length."""
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    truncated = torch.tensor([float(s.finish_reason == "length") for s in samples])
    longest = collectives.all_reduce(lengths.max().reshape(1).double(), run.parallel.dp_group, op="max")
    return {"response_length/mean": lengths, "response_length/clip_ratio": truncated}, float(longest[0])


def _component_means(run, metrics: dict, size: int) -> dict[str, torch.Tensor]:
    """Pop the reward components (lists) out of `metrics`; every DP rank gets the same names (the
    union), so the one reduction that averages them has one shape everywhere. A name this rank
    lacks counts 0.0 for each of its `size` responses (a rank none of whose rewards gave components
    still weighs in with all of them)."""
    mine = {k: metrics.pop(k) for k in [k for k, v in metrics.items() if isinstance(v, list)]}
    names = sorted(mine)
    if run.parallel.dp_size > 1:
        names = sorted({k for ks in collectives.all_gather_objects(names, run.parallel.dp_group) for k in ks})
    return {k: torch.tensor(mine.get(k, [0.0] * size), dtype=torch.float32) for k in names}


def _advantages(run, rewards: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """token_counts [N]: response tokens of each kept sample (0 for a dropped group)."""
    from megatron_rl.algo.advantages import grpo_advantages, reinforce_baseline_advantages

    est, n = run.cfg.algo.advantage_estimator, run.cfg.rollout.n_samples_per_prompt
    if est == "reinforce_plus_plus_baseline":  # whitened over the global batch: DP ranks reduce
        return reinforce_baseline_advantages(rewards, n, token_counts, reduce=run.parallel.dp_reducer())
    return grpo_advantages(rewards, n, norm_by_std=est == "grpo", leave_one_out=est == "rloo")


@dataclass
class _Round:
    """One generation round of a step: this rank's samples, their rewards and the dynamic-sampling
    decision; `counts` is every DP rank's number of kept groups [dp] (all-reduced)."""

    prompts: list
    samples: list
    accuracy: torch.Tensor
    penalty: torch.Tensor
    keep: torch.Tensor
    garbled: torch.Tensor | None
    stats: dict[str, float]
    components: dict[str, list]
    counts: torch.Tensor
    seconds: float

    @property
    def rewards(self) -> torch.Tensor:
        return self.accuracy + self.penalty  # what the advantages use


def _sample_round(run, prompts, step: int, index: int) -> _Round:
    """Engine rank samples its shard; its model-parallel peers receive the samples by broadcast."""
    from megatron_rl.algo.advantages import dynamic_sampling_keep

    t0 = time.perf_counter()
    prompts = _shard(prompts, run.parallel)
    salt = run.parallel.dp_rank + 1000 * index  # round 0: the seeds of a run without refill
    samples = _generate_on_engine(run, prompts, step, salt) if run.is_engine_rank else None
    samples = _broadcast_from_engine_rank(samples, run.parallel, run.host_groups)
    if run.host_groups is not None:  # replicas finish their rollouts apart: wait here (gloo), not in
        collectives.barrier(run.host_groups.dp)  # the next NCCL data-parallel reduction
    seconds = time.perf_counter() - t0
    accuracy, stats, garbled = _score_on_engine_rank(run, prompts, samples)
    components = {k: stats.pop(k) for k in [k for k, v in stats.items() if isinstance(v, list)]}
    penalty = _overlong(run, samples)
    n, a = run.cfg.rollout.n_samples_per_prompt, run.cfg.algo
    keep = dynamic_sampling_keep(accuracy + penalty, n) if a.dynamic_sampling else torch.ones(len(samples), dtype=torch.bool)
    counts = torch.zeros(run.parallel.dp_size, dtype=torch.float64)
    counts[run.parallel.dp_rank] = float(keep.sum()) / n
    counts = run.parallel.dp_reducer()(counts).round().long()
    return _Round(prompts, samples, accuracy, penalty, keep, garbled, stats, components, counts, seconds)


def generate(run, prompts, step: int) -> Rollout:
    """Sample and score `prompts`; with DAPO dynamic sampling, further batches from the loader until
    data.prompts_per_step informative groups are kept (loop/refill.py). Reward metrics are over
    every response sampled; the batch holds the kept groups only."""
    from megatron_rl.loop import refill

    target = run.cfg.data.prompts_per_step
    rounds = [_sample_round(run, prompts, step, 0)]
    while refill.needs_more(run.cfg.algo, target, [r.counts for r in rounds], step):
        rounds.append(_sample_round(run, run.loader.next_batch(), step, len(rounds)))
    metrics = _rollout_metrics(run, rounds)
    if _dump_step(run, step):
        _dump_samples(run, step, rounds[0])
    taken, most, kept_groups = refill.plan([r.counts for r in rounds], target, run.parallel.dp_rank)
    if run.cfg.algo.dynamic_sampling:
        metrics.update({"dapo/gen_batches": float(len(rounds)), "dapo/kept_groups": float(kept_groups),
                        "dapo/kept_fraction": kept_groups / target})
    if most == 0:
        metrics["step/skipped"] = 1.0
        return Rollout(None, metrics)
    metrics["step/skipped"] = 0.0
    return Rollout(_kept_batch(run, rounds, taken, most), metrics)


def _dump_step(run, step: int) -> bool:
    """The same answer on every rank (the dump's advantages may need a DP collective)."""
    every = run.cfg.log.dump_samples_every
    return bool(every) and step % every == 0


def _dump_samples(run, step: int, first: "_Round") -> None:
    """log.dump_samples_num samples of the first round on the log rank (its data-parallel shard) as
    the reward saw them (text cut at a stop string), with the advantages of that round. Called on
    every rank: REINFORCE++'s advantages all-reduce over DP."""
    from megatron_rl.telemetry.samples import sample_records, write_samples

    lengths = torch.tensor([len(s.response_ids) for s in first.samples], dtype=torch.float32)
    advantages = _advantages(run, first.rewards, lengths * first.keep)
    if not run.is_log_rank:
        return
    prompts, samples = first.prompts, first.samples
    n = run.cfg.rollout.n_samples_per_prompt
    records = sample_records(
        prompts=[prompts[s.prompt_index].prompt_text for s in samples],
        responses=response_texts(run.tokenizer, samples, run.cfg.rollout.stop), rewards=first.rewards.tolist(),
        advantages=advantages.tolist(), lengths=[len(s.response_ids) for s in samples],
        finish_reasons=[s.finish_reason for s in samples], answers=[prompts[i // n].answer for i in range(len(samples))],
        components={k.removeprefix("reward/"): list(v) for k, v in first.components.items()},
        limit=run.cfg.log.dump_samples_num)
    write_samples(run.cfg.log.dir, step, records)


def _rollout_metrics(run, rounds: list["_Round"]) -> dict[str, float]:
    """Means over every response of every round and DP rank, before dynamic sampling drops any."""
    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(r, name) for r in rounds])

    rewards = cat("rewards")
    length_means, longest = _length_metrics(run, [s for r in rounds for s in r.samples])
    names = sorted({k for r in rounds for k in r.components})
    listed = {k: [v for r in rounds for v in r.components.get(k, [0.0] * len(r.samples))] for k in names}
    components = _component_means(run, listed, len(rewards))
    means = {"reward/mean": rewards, "reward/sq": rewards**2, "reward/accuracy": cat("accuracy"),
             "reward/overlong_penalty": cat("penalty"), **length_means,
             "dynamic_sampling/kept_frac": cat("keep").float(), **components}
    if rounds[0].garbled is not None:
        means["health/garbled_rate"] = cat("garbled")
    metrics = {k: sum(r.stats[k] for r in rounds) for k in rounds[0].stats}
    metrics.update(_reduced_means(run, means))
    metrics["reward/std"] = max(metrics.pop("reward/sq") - metrics["reward/mean"] ** 2, 0.0) ** 0.5
    metrics["response_length/max"] = longest
    metrics["time/rollout"] = sum(r.seconds for r in rounds)
    return metrics


def _kept_batch(run, rounds: list["_Round"], taken: list[int], most: int) -> Batch:
    """The kept groups this rank trains (`taken` per round), then fully masked copies of its first
    group up to `most` groups, so every DP rank holds as many rows (the collectives stay matched)
    while the loss, its denominator and the metrics see exactly the kept rows. The advantages are
    computed once over the kept rows of all rounds (whole groups; REINFORCE++ whitens over them)."""
    from megatron_rl.loop.refill import kept_rows

    n = run.cfg.rollout.n_samples_per_prompt
    samples, rewards = [], []
    for r, take in zip(rounds, taken):
        rows = kept_rows(r.keep, n, take)
        samples += [r.samples[i] for i in rows.tolist()]
        rewards.append(r.rewards[rows])
    real = len(samples)
    filler = most * n - real
    samples += (rounds[0].samples[:n] * most)[:filler]
    rewards.append(torch.zeros(filler))
    rewards = torch.cat(rewards)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    lengths[real:] = 0.0
    batch = collate(samples, _advantages(run, rewards, lengths), run.tokenizer.pad_token_id)
    batch["loss_mask"][real:] = 0.0
    batch["advantages"][real:] = 0.0
    if run.cfg.algo.kl_reward_coef > 0:
        batch["rewards"] = rewards  # [B]: prepare subtracts the KL penalty, recomputes advantages
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


def _logprobs(run, batch: Batch, fp8: bool = True, model=None) -> torch.Tensor:
    """Log-probs [B, S] of `model` (the actor by default), packed and chunked as the training pass."""
    actor_batch, mbs, restore = _actor_batch(run, batch)
    out = (model or run.actor).compute_logprobs(actor_batch, micro_batch_size=mbs, with_entropy=False, fp8=fp8,
                                                logprob_chunk_size=run.cfg.train.logprob_chunk_size)
    return restore(out["logprobs"])


def _old_logprobs(run, batch: Batch) -> torch.Tensor:
    """The trainer's old log-probs in algo.old_logprob_precision; with calibrated FP8 KV scales the
    same forward records K/V amax."""
    fp8 = run.cfg.algo.old_logprob_precision == "train"
    calibration = run.kv_calibration
    if calibration is None:
        return _logprobs(run, batch, fp8=fp8)
    with calibration.recording(run.actor.model):
        return _logprobs(run, batch, fp8=fp8)


def skips_old_forward(run) -> bool:
    """force_on_policy_ratio with one mini-batch and one epoch: the only mini-batch takes its old
    log-probs from its own training forward, so the recompute is skipped (NeMo-RL's grpo.py does the
    same) unless another consumer needs pi_old before the update: the reference pass (kl/ref_mean,
    the KL reward), the BF16 shadow, or the K/V amax recording of calibrated FP8 KV scales."""
    cfg = run.cfg
    one = cfg.train.ppo_epochs * cfg.train.num_mini_batches == 1
    others = run.ref is not None or cfg.calib.enabled or cfg.calib.diagnose or run.kv_calibration is not None
    return cfg.algo.force_on_policy_ratio and one and not others


def _reduce_sum(run, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    return float(run.parallel.dp_reducer()(t)[0])


def _reduced_means(run, named: dict[str, torch.Tensor]) -> dict[str, float]:
    """Means over the global batch: sums and counts all-reduced over DP in one call."""
    stacked = torch.tensor([[float(v.sum()), float(v.numel())] for v in named.values()], dtype=torch.float64)
    stacked = run.parallel.dp_reducer()(stacked)
    return {k: float(s / max(c, 1.0)) for k, (s, c) in zip(named, stacked.tolist())}


def prepare(run, batch: Batch | None, step: int, metrics: dict[str, float], memory=None) -> Batch | None:
    """Old log-probs (trainer recompute in the FP8 recipe, or the rollout's), then the reference
    model's (KL terms; once per step, on the device only for that pass when `memory`, the
    colocated protocol, says so). The BF16 shadow's old log-probs are computed in update_policy,
    on the calibration rows only.

    Returns None (the step is skipped: no update, no sync) when there is nothing to train on or
    when any old log-prob on a response token is NaN/Inf: never a silent wrong update.
    """
    if batch is None:
        return None
    t0 = time.perf_counter()
    if run.cfg.algo.use_rollout_logprobs:
        batch["old_logprobs"] = batch["rollout_logprobs"].clone()
    elif not skips_old_forward(run):  # skipped: the one mini-batch's loss uses its own forward
        batch["old_logprobs"] = _old_logprobs(run, batch)
    metrics["time/old_logprobs"] = time.perf_counter() - t0
    if run.ref is not None:
        _reference(run, batch, metrics, memory)
    bad = _count_nonfinite(run, batch)
    metrics["guard/nonfinite_logprobs"] = bad
    if bad:
        log.warning("step %d: %d non-finite old log-probs on response tokens: step skipped", step, int(bad))
        metrics["step/skipped"] = 1.0
        return None
    return batch


def _reference(run, batch: Batch, metrics: dict[str, float], memory) -> None:
    """batch["ref_logprobs"] [B, S] from the frozen reference (algo.ref_precision), kl/ref_mean
    (the kl_loss_type estimate of KL(pi_old || pi_ref) per response token), and with
    algo.kl_reward_coef the reward penalty, which recomputes the advantages."""
    from megatron_rl.algo.kl import kl_estimate

    t0, a, mask = time.perf_counter(), run.cfg.algo, batch["loss_mask"]
    with memory.reference_on_device() if memory is not None else contextlib.nullcontext():
        batch["ref_logprobs"] = _logprobs(run, batch, fp8=a.ref_precision == "train", model=run.ref)
    metrics["time/ref_logprobs"] = time.perf_counter() - t0
    kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], a.kl_loss_type) * mask
    sums = run.parallel.dp_reducer()(torch.tensor([float(kl.sum()), float(mask.sum())], dtype=torch.float64))
    metrics["kl/ref_mean"] = float(sums[0] / max(float(sums[1]), 1.0))
    if "rewards" in batch:
        _kl_in_reward(run, batch, metrics)


def _kl_in_reward(run, batch: Batch, metrics: dict[str, float]) -> None:
    """verl's use_kl_in_reward for outcome rewards: reward_i - coef * sum_t KL_t (kl_reward_type,
    old vs reference, response tokens), then the group advantages of those rewards. Rows that
    dynamic sampling dropped (loss mask 0) keep advantage 0."""
    from megatron_rl.algo.kl import kl_estimate

    a, mask = run.cfg.algo, batch["loss_mask"]
    kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], a.kl_reward_type) * mask
    penalty = a.kl_reward_coef * kl.sum(-1)
    rewards = batch.pop("rewards") - penalty
    kept = (mask.sum(-1) > 0).float()
    batch["advantages"] = _advantages(run, rewards, mask.sum(-1) * kept)[:, None] * mask * kept[:, None]
    sums = run.parallel.dp_reducer()(torch.tensor([float((penalty * kept).sum()), float(kept.sum())],
                                                  dtype=torch.float64))
    metrics["kl/reward_penalty"] = float(sums[0] / max(float(sums[1]), 1.0))


def _count_nonfinite(run, batch: Batch) -> float:
    on = batch["loss_mask"] > 0
    bad = sum((~torch.isfinite(batch[k]) & on).sum()
              for k in ("old_logprobs", "old_logprobs_ref", "ref_logprobs") if k in batch)
    return _reduce_sum(run, float(bad))


def _shadow_step(run, step: int) -> bool:
    c = run.cfg.calib
    return (c.enabled or c.diagnose) and run.controller.should_calibrate(step)


def _bounds(run) -> tuple[float, float]:
    a = run.cfg.algo
    # max(0, .): CISPO's eps_clip >= 1 means no lower bound on its weight (slime, MiniMax-M1).
    return run.controller.bounds if run.cfg.calib.enabled else (max(0.0, 1.0 - a.eps_clip), 1.0 + a.eps_clip_high)


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
# With calib.dump_dir: the histogram's inputs of one micro-batch, stacked [len(HIST_INPUTS), B, T],
# dumped next to the histogram so that it can be rebuilt independently (tests/e2e/test_calib_dump.py).
HIST_INPUTS_KEY = "calib/_histogram_inputs"
HIST_INPUTS = ("logprobs", "old_logprobs", "rollout_logprobs", "ratio_ref", "advantages", "loss_mask")


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
    from megatron_rl.algo.policy_loss import LOG_RATIO_CLAMP, loss_mask, loss_token_weights

    a = run.cfg.algo
    mask, old, rollout = mb["loss_mask"].cpu(), mb["old_logprobs"].cpu(), mb["rollout_logprobs"].cpu()
    log_ratio = ((logprobs.detach().float().cpu() - old) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weights = loss_token_weights(mask, a.loss_agg_mode, old, rollout, a.use_tis, **_rs_kwargs(a),
                                 mode=a.tis_mode, tis_clip=a.tis_clip, tis_clip_low=a.tis_clip_low,
                                 icepop_low=a.icepop_low, icepop_high=a.icepop_high, level=a.tis_level)
    hist = run.controller.new_histogram()
    if run.cfg.calib.level == "sequence":  # GSPO: one entry per sequence, over the tokens the loss keeps
        kept = loss_mask(mask, old, rollout, **_rs_kwargs(a))
        hist.add_sequences(log_ratio, torch.log(mb["ratio_ref"].cpu()), mb["advantages"].cpu(), kept,
                           weights=weights, dual_clip=a.eps_clip_c)
    else:
        hist.add(log_ratio.exp(), mb["ratio_ref"].cpu(), mb["advantages"].cpu(), mask, weights=weights,
                 dual_clip=a.eps_clip_c)
    return hist.payload


def _rs_kwargs(a) -> dict:
    """The rejection-sampling knobs of algo config `a`, as policy_loss / loss_mask take them."""
    return {"rollout_rs": a.rollout_rs, "rollout_rs_threshold": a.rollout_rs_threshold,
            "rollout_rs_threshold_low": a.rollout_rs_threshold_low}


def _calibrate(run, metric_dicts: list[dict], step: int) -> dict[str, float]:
    """New (L, H) from the calibration mini-batch's histograms (popped from its loss metrics).

    Without calibration (diagnose only) the controller still runs, but its bounds are not applied.
    """
    hist = run.controller.new_histogram()
    for m in metric_dicts:
        hist.merge(m.pop(HIST_KEY))
    inputs = [m.pop(HIST_INPUTS_KEY) for m in metric_dicts if HIST_INPUTS_KEY in m]
    dumps = _dumps_calibration(run)
    local = hist.payload.clone() if dumps else None  # this rank's micro-batches, before the DP all-reduce
    out = run.controller.update_from_histogram(hist, reduce=run.parallel.dp_reducer(), step=step)
    assert_same_across_model_parallel(run.controller.bounds, run.parallel)
    _log_calibration(out, step)
    if dumps:
        _dump_histogram(run, hist, step, local, inputs)
    return out if run.cfg.calib.enabled else _renamed(out, DIAGNOSE_KEYS)


def assert_same_across_model_parallel(bounds: tuple[float, float], parallel) -> None:
    """(L, H) must be bitwise identical on every TP x PP rank of a replica (RuntimeError if not)."""
    if parallel.tp_size * parallel.pp_size == 1:
        return
    everyone = collectives.all_gather_objects(tuple(bounds), parallel.mp_group)
    if any(b != everyone[0] for b in everyone):
        raise RuntimeError(f"calibrated (L, H) differ across the model-parallel group: {everyone}")


def _log_calibration(out: dict[str, float], step: int) -> None:
    if out["calib/skipped"]:
        reason = next(k for k in out if k.startswith("calib/skipped_") and out[k])
        log.warning("step %d: calibration skipped (%s); bounds kept, retried next step", step, reason)
        return
    kept = [k for k in ("calib/high_unattainable", "calib/high_edge", "calib/high_no_bf16_upper_clip",
                        "calib/high_undefined", "calib/low_edge") if out.get(k)]
    if kept:
        log.info("step %d: previous bound kept (%s)", step, ", ".join(k.split("/")[1] for k in kept))


def _dumps_calibration(run) -> bool:
    """calib.dump_dir is set and this rank writes it (the log rank)."""
    return bool(run.cfg.calib.dump_dir) and run.is_log_rank


def _dump_histogram(run, hist, step: int, local: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """calib_<step>.pt: the reduced histogram, this rank's own (local_payload) and the inputs it was
    built from, one [len(HIST_INPUTS), B, T] tensor per micro-batch (micro_batches)."""
    from pathlib import Path

    a = run.cfg.algo
    path = Path(run.cfg.calib.dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "payload": hist.payload, "eps_low": hist.eps_low, "eps_high": hist.eps_high,
                "num_bins": hist.num_bins, "log_ratio_range": hist.log_ratio_range,
                "bounds": run.controller.bounds, "local_payload": local, "input_names": HIST_INPUTS,
                "micro_batches": inputs,
                "algo": {"use_tis": a.use_tis, "tis_mode": a.tis_mode, "tis_clip": a.tis_clip,
                         "loss_agg_mode": a.loss_agg_mode, "level": run.cfg.calib.level}},
               path / f"calib_{step:06d}.pt")


def loss_spec(a, bounds: tuple[float, float], forced: bool = False):
    """policy_loss's knobs from the algo config `a` at the clip bounds (L, H) in force; the false-clip
    metrics judge the BF16 reference ratio at the configured bounds (1 - eps_clip, 1 + eps_clip_high).
    `forced`: this mini-batch's ratio is forced to 1 (algo.force_on_policy_ratio, first mini-batch)."""
    from megatron_rl.algo.loss_spec import LossSpec

    return LossSpec(
        clip_low=bounds[0], clip_high=bounds[1], eps_clip_c=a.eps_clip_c, loss_agg_mode=a.loss_agg_mode,
        loss_mode=a.loss_mode, use_tis=a.use_tis, tis_clip=a.tis_clip, tis_clip_low=a.tis_clip_low,
        tis_mode=a.tis_mode, tis_level=a.tis_level, icepop_low=a.icepop_low, icepop_high=a.icepop_high,
        **_rs_kwargs(a), dro_beta=a.dro_beta, kl_loss_type=a.kl_loss_type, kl_loss_coef=a.kl_loss_coef,
        entropy_coef=a.entropy_coef, ref_clip_low=1.0 - a.eps_clip, ref_clip_high=1.0 + a.eps_clip_high,
        force_on_policy_ratio=forced)


def _loss_fn(run, denominator: float, bounds: tuple[float, float], calibrating: bool = False,
             forced: bool = False):
    from megatron_rl.algo.policy_loss import policy_loss

    spec = loss_spec(run.cfg.algo, bounds, forced)  # once per mini-batch: checked here, not per micro-batch

    def loss_fn(logprobs, entropy, mb):
        logprobs, entropy, mb = per_sequence(logprobs, entropy, mb)  # packed: seq-mean stays exact
        loss, metrics = policy_loss(
            logprobs, mb.get("old_logprobs"), mb["advantages"], mb["loss_mask"], spec, denominator=denominator,
            rollout_logprobs=mb["rollout_logprobs"], ref_logprobs=mb.get("ref_logprobs"), entropy=entropy,
            ratio_ref=mb.get("ratio_ref"))
        if calibrating:
            metrics[HIST_KEY] = _histogram_payload(run, logprobs, mb)
            if _dumps_calibration(run):
                metrics[HIST_INPUTS_KEY] = torch.stack(
                    [(logprobs if k == "logprobs" else mb[k]).detach().float().cpu() for k in HIST_INPUTS])
        return loss, metrics
    return loss_fn


def _denominator(run, mb: Batch, reduce) -> float:
    """The global loss denominator of a mini-batch, counted on the tokens the loss keeps (the
    rejection mask removes some); `reduce` sums over the DP group."""
    from megatron_rl.algo.policy_loss import loss_denominator, loss_mask

    kept = loss_mask(mb["loss_mask"], mb.get("old_logprobs"), mb["rollout_logprobs"], **_rs_kwargs(run.cfg.algo))
    return loss_denominator(kept, run.cfg.algo.loss_agg_mode, reduce=reduce)


def update_policy(run, batch: Batch, step: int) -> dict[str, float]:
    """PPO epochs over shuffled mini-batches; on shadow steps the last mini-batch calibrates.

    The calibration mini-batch trains with the bounds in force, and its own training forward
    provides the FP8 ratio; the new (L, H) apply from the next step. Its BF16 theta_old pass runs
    before the first update (the splits are drawn up front, the same draws as one by one)."""
    from megatron_rl.algo.metrics import reduce_metrics

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
            denominator = _denominator(run, mb, reduce)
            actor_mb, mbs, _ = _actor_batch(run, mb)
            forced = cfg.algo.force_on_policy_ratio and epoch == 0 and i == 0
            result = run.actor.train_step(actor_mb, _loss_fn(run, denominator, _bounds(run), calibrating, forced),
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
