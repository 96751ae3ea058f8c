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
    assert collectives.all_gather_objects("x", None) == ["x"]
    assert collectives.group_ranks(None) == [0]
    assert collectives.make_host_groups([0], [0]) == collectives.HostGroups(None, None, None)
    collectives.barrier(None)  # nothing to wait for


def _one_rank_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from megatron_rl import collectives

    dist.init_process_group("gloo")
    hosts = collectives.make_host_groups([0], [0])
    return {"hosts": [hosts.mp, hosts.dp, hosts.world], "ranks": collectives.group_ranks(None)}


def test_a_one_rank_world_needs_no_host_groups():
    (r0,) = run_distributed(_one_rank_worker, world_size=1, timeout_s=60)
    assert r0["ranks"] == [0]
    assert r0["hosts"] == [None, None, None]


def _long_wait_worker(rank: int, world_size: int) -> dict:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_rl import collectives

    # The default group's timeout stands for NCCL's watchdog: shorter than the waits below.
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    long = collectives.make_host_groups([rank], [0, 1], timeout_s=60.0)
    short = collectives.make_host_groups([0, 1], [0, 1], timeout_s=1.0)
    out = {"mp": collectives.group_ranks(long.mp), "dp": collectives.group_ranks(long.dp)}
    if rank == 1:
        time.sleep(5.0)  # a server start / a rollout tail on the other rank
    t0 = time.perf_counter()
    collectives.barrier(long.world)  # outlasts the default group's 2 s: fine on the host world
    out["waited_s"] = time.perf_counter() - t0
    # Each of the three host groups has the 1 s timeout it was made with (rank 1 arrives 4 s late:
    # rank 0 times out on the world, then the mp, then the dp group; rank 1's outcomes are moot).
    if rank == 1:
        time.sleep(4.0)
    for name in ("world", "mp", "dp"):
        try:
            collectives.barrier(getattr(short, name))
            out[f"short_{name}"] = "passed"
        except RuntimeError as err:  # gloo: "Timed out waiting 1000ms"
            out[f"short_{name}"] = "timed out" if "imed out" in str(err) else str(err)
    if rank == 0:
        time.sleep(6.0)  # let rank 1 leave its barriers before the groups go
    return out


def test_host_groups_wait_as_long_as_their_own_timeout():
    r0, r1 = run_distributed(_long_wait_worker, world_size=2, timeout_s=120)
    assert (r0["mp"], r1["mp"], r0["dp"]) == ([0], [1], [0, 1])
    assert r0["waited_s"] > 4.0  # rank 0 waited for rank 1's 5 s past the default group's 2 s
    # and each group's own timeout still catches a hang
    assert [r0[f"short_{name}"] for name in ("world", "mp", "dp")] == ["timed out"] * 3


def _grid_worker(rank: int, world_size: int) -> dict:
    """4 ranks, groups [0, 2] and [1, 3]: group ranks differ from global ranks, so a helper that
    mixes the two (a source, a destination, a member list) answers wrongly here."""
    import time

    import torch
    import torch.distributed as dist

    from megatron_rl import collectives

    dist.init_process_group("gloo")
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    group = odds if rank % 2 else evens
    out = {"size": collectives.group_size(group), "ranks": collectives.group_ranks(group),
           "world_ranks": collectives.group_ranks(None), "member1": collectives.global_rank(group, 1),
           "member0_default": collectives.global_rank(None, 0)}
    t = torch.tensor([float(rank), 1.0])
    collectives.all_reduce(t, group)
    lo, hi = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    collectives.all_reduce(lo, group, op="min")
    collectives.all_reduce(hi, group, op="max")
    b = torch.full((3,), float(rank))
    collectives.broadcast(b, group_src=1, group=group)  # group rank 1: global 2 or 3
    last = collectives.group_ranks(group)[1]
    obj = collectives.broadcast_object(f"from {rank}" if rank == last else None, last, group)
    gathered = collectives.gather_objects(rank * 10, last, group)
    everyone = collectives.all_gather_objects(rank, None)
    pair_gathered = collectives.all_gather_objects(rank * 7, group)
    # A barrier waits for its own group only: rank 3 arrives 2 s late, which holds rank 1 (its
    # group [1, 3]) and not ranks 0 and 2.
    if rank == 3:
        time.sleep(2.0)
    t0 = time.perf_counter()
    collectives.barrier(group)
    barrier_s = time.perf_counter() - t0
    hosts = collectives.make_host_groups([rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2],
                                         timeout_s=60.0)
    host_sum = torch.tensor([float(rank)])
    collectives.all_reduce(host_sum, hosts.mp)
    collectives.barrier(hosts.world)
    out.update(sum=t.tolist(), min=lo.item(), max=hi.item(), bcast=b.tolist(), obj=obj, gathered=gathered,
               everyone=everyone, pair_gathered=pair_gathered, barrier_s=barrier_s,
               host_mp=collectives.group_ranks(hosts.mp),
               host_dp=collectives.group_ranks(hosts.dp), host_world=collectives.group_ranks(hosts.world),
               host_sum=host_sum.item())
    return out


def test_collectives_on_four_processes_use_group_ranks_where_they_must():
    results = run_distributed(_grid_worker, world_size=4, timeout_s=150)
    for rank, r in enumerate(results):
        mine = [rank % 2, rank % 2 + 2]
        assert r["size"] == 2 and r["ranks"] == mine and r["world_ranks"] == [0, 1, 2, 3]
        assert r["member1"] == mine[1] and r["member0_default"] == 0
        assert r["sum"] == [float(sum(mine)), 2.0]
        assert (r["min"], r["max"]) == (float(mine[0]), float(mine[1]))
        assert r["bcast"] == [float(mine[1])] * 3
        assert r["obj"] == f"from {mine[1]}"
        assert r["gathered"] == ([10 * mine[0], 10 * mine[1]] if rank == mine[1] else None)
        assert r["everyone"] == [0, 1, 2, 3]
        assert r["pair_gathered"] == [7 * mine[0], 7 * mine[1]]
    assert results[1]["barrier_s"] > 1.5 and results[0]["barrier_s"] < 1.0 and results[2]["barrier_s"] < 1.0
    for rank, r in enumerate(results):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        mine = [rank % 2, rank % 2 + 2]
        assert r["host_mp"] == pair and r["host_dp"] == mine and r["host_world"] == [0, 1, 2, 3]
        assert r["host_sum"] == float(sum(pair))
