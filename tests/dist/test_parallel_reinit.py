"""init_parallel called again in one process (a run built after another: tests, a harness running
several arms) leaks nothing: Megatron's parallel_state never destroys its process groups, and each
gloo group holds three threads until destroyed."""

from __future__ import annotations

import os
from pathlib import Path

from _launch import run_distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tiny"
TINY = ["model.tiny_hidden_size=32", "model.tiny_ffn_hidden_size=64", "train.sft_steps=0", "data.num_examples=32",
        "log.progress=false", "log.tensorboard=false", "log.plot=false", "eval.datasets=[]"]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _registered() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _reinit_worker(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    from megatron_rl.actor.parallel import init_parallel

    first = init_parallel(2, 1, seed=0)
    at_tp2 = (_registered(), _threads())
    again = init_parallel(2, 1, seed=0)  # the same sizes: the same groups, still usable
    same = again.tp_group is first.tp_group and mps.get_tensor_model_parallel_world_size() == 2
    one = init_parallel(1, 1, seed=0)  # other sizes: the TP=2 groups destroyed, TP=1 ones made
    old_destroyed = first.tp_group not in dist.distributed_c10d._world.pg_map
    del first, again  # a destroyed group's threads end with its last reference
    at_tp1 = (_registered(), _threads())
    tp1 = (one.tp_size, one.dp_size)
    del one
    back = init_parallel(2, 1, seed=0)
    t = torch.ones(1)
    dist.all_reduce(t, group=back.tp_group)  # the new TP=2 group works
    return dict(at_tp2=at_tp2, at_tp1=at_tp1, at_tp2_again=(_registered(), _threads()), same=same,
                old_destroyed=old_destroyed, tp1=tp1, sum=t.item())


def test_reinit_at_other_sizes_destroys_the_old_groups_on_two_processes():
    for r in run_distributed(_reinit_worker, world_size=2, timeout_s=180):
        assert r["same"] and r["old_destroyed"] and r["tp1"] == (1, 2) and r["sum"] == 2.0
        # one set of groups at a time: before, each init added 17 groups and 51 threads
        assert r["at_tp1"] == r["at_tp2"] == r["at_tp2_again"]


def test_reinit_at_the_same_sizes_keeps_groups_and_threads():
    """In-process, as the tests and a multi-arm harness do: ten inits, one set of groups."""
    import torch
    import torch.distributed as dist

    from megatron_rl.actor.parallel import destroy_parallel, init_parallel

    was = dist.is_initialized()
    first = init_parallel(1, 1, seed=0)
    groups, threads = _registered(), _threads()
    for _ in range(10):
        info = init_parallel(1, 1, seed=3)
    drawn = torch.rand(2)
    init_parallel(1, 1, seed=3)
    assert torch.equal(torch.rand(2), drawn)  # a re-init at the same sizes still seeds
    assert (_registered(), _threads()) == (groups, threads)  # before: 17 groups and 51 threads per init
    assert info.dp_group is first.dp_group
    if not was:
        destroy_parallel()
        assert _registered() == 0


def _run_and_destroy_worker(rank: int, world_size: int, log_dir: str) -> dict:
    from megatron_rl.actor.parallel import destroy_parallel
    from megatron_rl.config import load_config
    from megatron_rl.loop import build

    before = _threads()
    cfg = load_config(EXAMPLES / "bf16.yaml", [*TINY, f"log.dir={log_dir}"])
    built, after = [], []
    for _ in range(3):  # runs one after another, as a harness builds its arms
        run_ = build.build_run(cfg)
        built.append(_threads())
        run_.finish()
        del run_
        destroy_parallel()
        after.append(_threads())
    return dict(before=before, built=built, after=after)


def test_destroy_parallel_ends_the_groups_threads(tmp_path):
    (r,) = run_distributed(_run_and_destroy_worker, world_size=1, args=(str(tmp_path / "run"),), timeout_s=180)
    assert min(r["built"]) >= r["before"] + 3 * 17, r  # Megatron's 17 gloo groups, three threads each
    # what a run leaves (torch's own threads, two groups' threads torch holds in C++) does not grow
    assert r["after"][0] == r["after"][1] == r["after"][2] < r["before"] + 3 * 17, r
