"""megatron_rl.collectives on 2 real gloo processes: values, devices and object placement."""

from _launch import run_distributed


def _worker(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_rl import collectives

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    t = torch.tensor([rank + 1.0, 10.0 * rank], dtype=torch.float64)
    collectives.all_reduce(t, group)
    m = torch.tensor([float(rank)])
    collectives.all_reduce(m, group, op="max")
    obj = collectives.broadcast_object({"from": rank} if rank == 1 else None, 1, group)
    gathered = collectives.gather_objects(f"r{rank}", 0, group)
    everyone = collectives.all_gather_objects(rank * 3, group)
    collectives.barrier(group)
    return dict(sum=t.tolist(), max=m.item(), obj=obj, gathered=gathered, everyone=everyone,
                device=str(collectives.group_device(group)), g1=collectives.global_rank(group, 1))


def test_collectives_on_two_processes():
    r0, r1 = run_distributed(_worker, world_size=2, timeout_s=120)
    for r in (r0, r1):
        assert r["sum"] == [3.0, 10.0]
        assert r["max"] == 1.0
        assert r["obj"] == {"from": 1}
        assert r["everyone"] == [0, 3]
        assert r["device"] == "cpu"
        assert r["g1"] == 1
    assert r0["gathered"] == ["r0", "r1"] and r1["gathered"] is None


def test_one_process_is_a_no_op():
    import torch

    from megatron_rl import collectives

    t = torch.tensor([2.0])
    assert collectives.all_reduce(t, None) is t and t.item() == 2.0
    assert collectives.broadcast_object("x", 0, None) == "x"
    assert collectives.gather_objects("x", 0, None) == ["x"]


def _long_wait_worker(rank: int, world_size: int) -> dict:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_rl import collectives

    # The default group's timeout stands for NCCL's watchdog: shorter than the waits below.
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    long = collectives.make_host_groups([rank], [0, 1], timeout_s=60.0)
    short = collectives.make_host_groups([rank], [0, 1], timeout_s=1.0)
    out = {"mp": collectives.group_ranks(long.mp), "dp": collectives.group_ranks(long.dp)}
    if rank == 1:
        time.sleep(5.0)  # a server start / a rollout tail on the other rank
    t0 = time.perf_counter()
    collectives.barrier(long.world)  # outlasts the default group's 2 s: fine on the host world
    out["waited_s"] = time.perf_counter() - t0
    if rank == 1:
        time.sleep(4.0)
    try:
        collectives.barrier(short.dp)
        out["short"] = "passed"
    except RuntimeError as err:  # gloo: "Timed out waiting 1000ms"
        out["short"] = "timed out" if "imed out" in str(err) else str(err)
    if rank == 0:
        time.sleep(5.0)  # let rank 1 leave its barrier before the group goes
    return out


def test_host_groups_wait_as_long_as_their_own_timeout():
    r0, r1 = run_distributed(_long_wait_worker, world_size=2, timeout_s=120)
    assert (r0["mp"], r1["mp"], r0["dp"]) == ([0], [1], [0, 1])
    assert r0["waited_s"] > 4.0  # rank 0 waited for rank 1's 5 s past the default group's 2 s
    assert r0["short"] == "timed out"  # and a group's own timeout still catches a hang
