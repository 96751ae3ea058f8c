"""A step's reward scoring with slow and hanging rewards: one worker against reward.num_workers pools, as JSON.

`--samples` responses (72: 9 prompts x 8 samples) scored by a reward that sleeps `--sleep` seconds per
sample, every `--hang-every`-th sample hanging past `--timeout` (counted as a timeout, its worker
restarted). Each pool size scores the same batch (after a warm-up call that starts its workers); the
ratio is the one-worker time over the pool's, measured in this run. The rewards and the failure counts
must not depend on the pool size (checked: "same_rewards").

examples:
  OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/reward_pool.py
  OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/reward_pool.py --workers 1 4 8 16 --sleep 0.5
"""

from __future__ import annotations

import argparse
import json
import logging
import time

HANG = "hang"


def slow_reward(response: str, answer: str) -> float:
    """A judge that takes its time: `sleep` seconds (encoded in the answer), forever on HANG."""
    time.sleep(3600 if response == HANG else float(answer))
    return float(len(response) % 2)


def _batch(samples: int, sleep: float, hang_every: int) -> tuple[list[str], list[str]]:
    responses = [HANG if hang_every and i % hang_every == hang_every - 1 else "x" * (i % 5) for i in range(samples)]
    return responses, [str(sleep)] * samples


def _score(workers: int, timeout: float, responses: list[str], answers: list[str]) -> dict:
    from megatron_rl.rewards import RewardRunner

    with RewardRunner(slow_reward, timeout_s=timeout, num_workers=workers) as runner:
        runner.score(["x"] * workers, ["0"] * workers)  # warm-up: every worker started
        t0 = time.perf_counter()
        rewards, stats = runner.score(responses, answers)
        seconds = time.perf_counter() - t0
    return {"num_workers": workers, "seconds": seconds, "num_errors": stats["num_errors"],
            "num_timeouts": stats["num_timeouts"], "rewards": rewards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=72)
    parser.add_argument("--sleep", type=float, default=0.4, help="seconds per sample")
    parser.add_argument("--timeout", type=float, default=0.5, help="reward.timeout_s")
    parser.add_argument("--hang-every", type=int, default=8, help="every N-th sample hangs (0: none)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 16])
    args = parser.parse_args()
    logging.getLogger("megatron_rl.rewards.runner").setLevel(logging.ERROR)  # the timeouts are expected
    responses, answers = _batch(args.samples, args.sleep, args.hang_every)
    runs = [_score(w, args.timeout, responses, answers) for w in sorted(set([1, *args.workers]))]
    base = runs[0]
    report = {"samples": args.samples, "sleep_s": args.sleep, "timeout_s": args.timeout, "hang_every": args.hang_every,
              "baseline_seconds": base["seconds"],
              "pools": [{k: v for k, v in r.items() if k != "rewards"} | {
                  "ratio_vs_one_worker": base["seconds"] / r["seconds"],
                  "same_rewards": r["rewards"] == base["rewards"]} for r in runs]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
