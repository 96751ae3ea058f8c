"""The RL loop: rollout -> reward -> advantages -> old log-probs -> PPO updates -> weight sync -> log -> save.

Run with `megatron-rl train CONFIG.yaml [section.key=value ...]`, or on several processes with
`torchrun --nproc-per-node N -m megatron_rl.train CONFIG.yaml ...`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from megatron_rl import collectives
from megatron_rl.loop import build, evaluate, phases, preflight, run_folder, signals
from megatron_rl.loop.best import BestCheckpoint
from megatron_rl.loop.colocated import ColocatedMemory, protocol_enabled
from megatron_rl.config import RunConfig, load_config
from megatron_rl.telemetry.health import SurgeDetector
from megatron_rl.cluster.plan import check_fits, job_cluster

log = logging.getLogger("megatron_rl.train")


def run(cfg: RunConfig, prepared: bool = False) -> dict[str, float]:
    """Train for cfg.train.num_steps RL steps; returns the last step's metrics. Every entry point
    comes here, so SIGUSR1 and SIGTERM are handled here (loop/signals.py). `prepared`: the caller
    ran preflight.prepare_run(cfg) already (the entry points, to print a refusal as one error line)."""
    with signals.handle_signals():
        return _train(cfg if prepared else preflight.prepare_run(cfg))


def _train(cfg: RunConfig) -> dict[str, float]:
    done = run_folder.finished_steps(cfg)
    if done is not None:  # a relaunch of a finished run: nothing to build (servers take minutes)
        if os.environ.get("RANK", "0") == "0":
            log.warning("the run in %s has done %d steps, train.num_steps=%d: nothing to train (raise "
                        "train.num_steps to continue it, or pass --overwrite)", cfg.log.dir, done, cfg.train.num_steps)
        return {}
    planned = check_fits(cfg, job_cluster())  # a config that cannot fit is refused before any work
    if planned is not None:
        log.info("memory plan: peak %.1f of %.0f GB per GPU", planned["peak_gb_per_gpu"], planned["gpu_mem_gb"])
    run_ = build.build_run(cfg)
    # Only the owner of a server set (the rank with a transport) releases and resumes it: clients
    # of the same servers would release them twice, and SGLang refuses a resume of what is not released.
    owned = run_.engine if run_.sync.transport is not None else None
    memory = ColocatedMemory(run_.actor, owned, enabled=protocol_enabled(cfg),
                             barrier_after_sync=run_.sync.wait_for_owners, reference=run_.ref,
                             wait_group=run_.sync.wait_group)
    signals.on_sigterm(run_.rewards.close, *([run_.engine.shutdown] if run_.engine is not None else []))
    metrics: dict[str, float] = {}
    evaluator = best = None
    try:  # finish() also stops engine servers and the reward worker when a step (or the first sync) raises
        evaluator, best = evaluate.Evaluator.build(run_), _best_checkpoint(run_)  # bad eval data: before any work
        start = run_.resume_step()
        if start == 0:  # a resumed run's checkpoint holds the planted weights already
            run_.plant_outliers()
        detector = _surge_detector(run_)
        memory.before_sync()
        run_.sync.sync()  # the engine starts from the trainer's weights, in the contract's format
        memory.after_sync()
        for step in range(start, cfg.train.num_steps):
            # The engine holds the weights after `step` updates here (colocated: it is resident).
            scores = _evaluate(run_, evaluator, best, step, step, memory) if evaluator and evaluator.due(step) else {}
            metrics = {**_step(run_, step, memory), **scores}
            if evaluator and cfg.eval.at_end and step == cfg.train.num_steps - 1:
                metrics.update(_evaluate(run_, evaluator, best, step, step + 1, memory))
            _add_health(detector, step, metrics, warn=run_.is_log_rank)
            run_.logger.log(step, metrics)
            _save(run_, step, memory, best)
            if _stop_after(run_, step, memory):
                break
    finally:
        run_.finish()
        if evaluator is not None:
            evaluator.close()
    if best is not None:  # an async save is published by finish()
        _update_best(run_, best, lambda: best.saved(run_.checkpointer.latest_step()))
    return metrics


def _best_checkpoint(run_: build.Run):
    """checkpoint.keep_best's record; its source is the eval set's settings (config checks the name)."""
    keep = run_.cfg.checkpoint.keep_best
    if not keep:
        return None
    name = keep.split("/", 1)[0]
    source = next(asdict(d) for d in run_.cfg.eval.datasets if d.name == name)
    return BestCheckpoint(run_.checkpointer.root, keep, enabled=run_.is_log_rank, source=source)


def _evaluate(run_: build.Run, evaluator, best, step: int, weights_step: int, memory) -> dict[str, float]:
    """Eval metrics of the engine's weights (those after `weights_step` updates); they join `step`'s."""
    scores = evaluator.evaluate(weights_step, memory, dump_dir=Path(run_.cfg.log.dir) / "eval_samples")
    if best is not None:
        _update_best(run_, best, lambda: best.scored(weights_step, scores, run_.checkpointer.latest_step()))
    return scores


def _update_best(run_: build.Run, best: BestCheckpoint, update) -> None:
    """Run `update` (a BestCheckpoint call). A new `best` frees the checkpoint the old one named: the
    last publish pruned while that one was still spared, and the run may save no more (the at_end
    evaluation pairs with the final save), so retention runs again at once."""
    before = best.step
    update()
    if best.step != before and run_.is_log_rank and run_.checkpointer.keep_last:
        run_.checkpointer.prune()


def _stop_after(run_: build.Run, step: int, memory: ColocatedMemory) -> bool:
    """A stop request with steps left: every rank stops after this same step (rank 0's view decides),
    with a checkpoint of it, and rank 0 names the step in MEGATRON_RL_STOP_FILE so that the job
    script requeues the job, which resumes from it. A request is SIGUSR1 to the rank or the file
    MEGATRON_RL_STOP_REQUEST existing (slurm/job.sh creates it on the job's warning signal: a signal
    sent through srun would reach every process of the step, torchrun included, which dies of it)."""
    if not collectives.broadcast_object(signals.stop_requested(), 0, None) or step + 1 >= run_.cfg.train.num_steps:
        return False
    if not run_.save_due(step):
        with memory.trainer_on_device():
            run_.checkpointer.save(run_, step + 1)
    run_.checkpointer.wait()
    if run_.is_log_rank:
        log.warning("stop requested: stopped after step %d with a checkpoint", step)
        if os.environ.get("MEGATRON_RL_STOP_FILE"):
            with open(os.environ["MEGATRON_RL_STOP_FILE"], "w") as f:
                f.write(f"{step + 1}\n")
    return True


def _save(run_: build.Run, step: int, memory: ColocatedMemory, best) -> None:
    """The step's checkpoint and HF export when due (the trainer on the device for them), then the
    best-checkpoint bookkeeping of what was published."""
    if not (run_.save_due(step) or run_.hf_export_due(step)):
        return
    with memory.trainer_on_device():
        run_.maybe_save(step)
        if run_.hf_export_due(step):
            run_.export_hf(step)
    if best is not None:
        _update_best(run_, best, lambda: best.saved(run_.checkpointer.latest_step()))


def _step(run_: build.Run, step: int, memory: ColocatedMemory) -> dict[str, float]:
    """One RL step; returns its metrics (a skipped step logs why and changes nothing)."""
    t0 = time.perf_counter()
    rollout = phases.generate(run_, run_.loader.next_batch(), step)
    metrics = dict(rollout.metrics)
    metrics["lr"] = run_.actor.lr  # what this step's updates use
    if rollout.batch is not None:
        metrics.update(memory.begin_training())  # colocated: engine out, trainer in
    batch = phases.prepare(run_, rollout.batch, step, metrics, memory)  # None: the step is skipped
    if batch is not None:
        metrics.update(phases.update_policy(run_, batch, step))
        run_.actor.advance_lr_schedule()  # per trained step: a skipped step leaves the schedule
    if batch is not None or (rollout.batch is not None and memory.enabled):
        # A released engine lost its weights: even a skipped update pushes them again.
        metrics.update(memory.before_sync())
        metrics.update(run_.sync.sync())
        metrics.update(memory.after_sync())
    metrics["time/step"] = time.perf_counter() - t0
    return metrics


def _surge_detector(run_: build.Run) -> SurgeDetector:
    """The health detector, rebuilt from the log's steps before the resume step (the logger keeps
    them): no state in the checkpoint. Only the log rank holds that history, so it sends the
    detector to every rank (world group); the inputs, `entropy` and `health/garbled_rate`, are
    global reductions, so every rank then computes the same health/* metrics."""
    detector = SurgeDetector.from_history(run_.cfg.health, run_.logger.history) if run_.is_log_rank else None
    return collectives.broadcast_object(detector, 0, None)


def _add_health(detector: SurgeDetector, step: int, metrics: dict[str, float], warn: bool) -> None:
    """Add the step's health/* metrics; `warn`: log once when the first entropy surge is detected."""
    before = detector.surge_step
    metrics.update(detector.update(step, metrics))
    if warn and before is None and detector.surge_step is not None:
        log.warning("step %d: entropy surge since step %d: entropy %.4g is %.0f%% above the run's minimum %.4g",
                    step, detector.surge_step, metrics["entropy"], 100 * metrics["health/entropy_rise"],
                    metrics["health/entropy_min"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m megatron_rl.train CONFIG.yaml [section.key=value ...]")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = preflight.prepare_run(load_config(argv[0], argv[1:]))
    except ValueError as err:
        print(f"megatron_rl.train: error: {err}", file=sys.stderr)
        return 2
    run(cfg, prepared=True)
    return 0


if __name__ == "__main__":
    torch.multiprocessing.set_start_method("spawn", force=True)
    sys.exit(main())
