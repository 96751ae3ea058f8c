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
