"""One model replica on 2 gloo processes (TP = 2): rewards scored once on the engine rank and
broadcast; calibrated (L, H) checked identical across the replica."""

from _launch import run_distributed


class _CountingRewards:
    """A reward function whose result depends on the process that runs it (as a timeout would)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    def score(self, texts, answers, extras=None):
        self.calls += 1
        return [float(len(t) + 10 * self.rank) for t in texts], {"num_errors": self.rank, "num_timeouts": 0}


def _worker(rank: int, world_size: int) -> dict:
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_rl.loop import phases
    from megatron_rl.config import load_config

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    parallel = SimpleNamespace(tp_size=2, pp_size=1, tp_rank=rank, pp_rank=0, mp_group=group)
    run = SimpleNamespace(cfg=load_config(None, ["rollout.n_samples_per_prompt=2"]), parallel=parallel, host_groups=None,
                          is_engine_rank=rank == 0, rewards=_CountingRewards(rank),
                          tokenizer=SimpleNamespace(batch_decode=lambda ids, **kw: ["x" * len(i) for i in ids]))
    prompts = [SimpleNamespace(answer="a", extra={})]
    samples = [SimpleNamespace(response_ids=[1, 2, 3]), SimpleNamespace(response_ids=[4])]
    rewards, metrics, garbled = phases._score_on_engine_rank(run, prompts, samples)
    phases.assert_same_across_model_parallel((0.75, 1.5), parallel)
    try:
        phases.assert_same_across_model_parallel((0.75, 1.5 + rank * 1e-12), parallel)
        differ = "not raised"
    except RuntimeError as err:
        differ = str(err)
    return dict(rewards=rewards.tolist(), errors=metrics["reward/errors"], calls=run.rewards.calls, differ=differ,
                garbled=garbled.tolist())


def test_rewards_scored_once_per_replica_and_bounds_checked():
    r0, r1 = run_distributed(_worker, world_size=2, timeout_s=120)
    assert r0["rewards"] == r1["rewards"] == [3.0, 1.0]  # rank 0's scores on both ranks
    assert r0["errors"] == r1["errors"] == 0.0
    assert r0["garbled"] == r1["garbled"] == [1.0, 1.0]  # "xxx", "x": not digits, fail sort's format
    assert (r0["calls"], r1["calls"]) == (1, 0)
    for r in (r0, r1):
        assert "differ across the model-parallel group" in r["differ"]
