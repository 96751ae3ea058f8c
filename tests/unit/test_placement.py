"""Placement plans worked by hand: hosts, ranks, servers (GPUs, ports), router, one owner per server set."""

from __future__ import annotations

import itertools
import json

import pytest

from megatron_rl.cluster.placement import plan_placement


def test_colocated_plan_by_hand():
    # 2 hosts x 4 GPUs, trainer TP 2 -> DP 4, heads (tp 0) are ranks 0 2 4 6; SGLang TP 2 -> 2 servers a host.
    p = plan_placement(["a", "b"], 4, layout="colocated", tp=2, server_tp=2)
    assert p.to_dict() == {
        "layout": "colocated",
        "hosts": [{"host": "a", "trainer_ranks": [0, 1, 2, 3],
                   "servers": [{"gpus": [0, 1], "port": 30000}, {"gpus": [2, 3], "port": 30001}], "router": None},
                  {"host": "b", "trainer_ranks": [4, 5, 6, 7],
                   "servers": [{"gpus": [0, 1], "port": 30000}, {"gpus": [2, 3], "port": 30001}], "router": None}],
        "transport_owners": [0, 4], "world_size": 8}
    assert [p.rollout_role(r) for r in range(8)] == ["owner", None, "client", None, "owner", None, "client", None]
    assert p.servers_for(4) == ["http://b:30000", "http://b:30001"] == p.owned_servers(4)
    assert p.servers_for(6) == ["http://b:30001", "http://b:30000"]  # head 6 prefers its own GPUs 2-3
    assert p.servers_for(7) == ["http://b:30000", "http://b:30001"]  # a TP peer (samples nothing): the host's
    assert p.owned_servers(6) == [] and p.starts_servers(4) and not p.starts_servers(6)
    assert p.local_rank(6) == 2 and p.master_addr == "a" and p.router_url == ""


def test_disaggregated_plan_by_hand():
    # 2 rollout hosts (SGLang TP 4: 2 servers each, router on the first) + 2 trainer hosts, TP 8 PP 2 -> DP 1.
    p = plan_placement(["r1", "r2", "t1", "t2"], 8, layout="disaggregated", tp=8, pp=2, server_tp=4,
                       rollout_nodes=2, base_port=31000, router_port=31999)
    d = p.to_dict()
    servers = [{"gpus": [0, 1, 2, 3], "port": 31000}, {"gpus": [4, 5, 6, 7], "port": 31001}]
    assert d["hosts"][0] == {"host": "r1", "trainer_ranks": [], "servers": servers, "router": {"port": 31999}}
    assert d["hosts"][1] == {"host": "r2", "trainer_ranks": [], "servers": servers, "router": None}
    assert d["hosts"][2] == {"host": "t1", "trainer_ranks": list(range(8)), "servers": [], "router": None}
    assert d["hosts"][3]["trainer_ranks"] == list(range(8, 16))
    assert d["transport_owners"] == [0] and d["world_size"] == 16 and d["layout"] == "disaggregated"
    assert p.coords(8) == {"tp": 0, "cp": 0, "dp": 0, "pp": 1} and p.rollout_role(8) is None
    assert p.owned_servers(0) == ["http://r1:31000", "http://r1:31001", "http://r2:31000", "http://r2:31001"]
    assert not p.starts_servers(0) and p.router_url == "http://r1:31999" and p.master_addr == "t1"


def test_disaggregated_data_parallel_heads_are_clients():
    # 1 trainer host of 4 GPUs, TP 1 -> DP 4: rank 0 owns the servers, 1..3 sample through them.
    p = plan_placement(["r", "t"], 4, layout="disaggregated", server_tp=2, rollout_nodes=1)
    assert [p.rollout_role(r) for r in range(4)] == ["owner", "client", "client", "client"]
    assert p.servers_for(3) == ["http://r:30000", "http://r:30001"] and p.owned_servers(3) == []


def test_embedded_plan_every_replica_owns_its_engine():
    p = plan_placement(["a", "b"], 2, layout="embedded", tp=2)
    assert p.to_dict()["hosts"][1] == {"host": "b", "trainer_ranks": [2, 3], "servers": [], "router": None}
    assert p.transport_owners == (0, 2) and p.owned_servers(0) == []
    # two replicas on one host each own their in-process engine (not one owner per host)
    assert plan_placement(["a"], 2, layout="embedded").transport_owners == (0, 1)


@pytest.mark.parametrize("hosts, gpus, layout, tp, pp, stp, roll", [
    (["a", "b", "c"], 8, "colocated", 2, 1, 1, 0), (["a", "b"], 8, "colocated", 4, 1, 2, 0),
    (["a", "b", "c"], 8, "disaggregated", 8, 2, 4, 1), (["a", "b", "c", "d"], 4, "disaggregated", 2, 1, 2, 2),
])
def test_no_gpu_or_port_used_twice_and_one_owner_per_server_set(hosts, gpus, layout, tp, pp, stp, roll):
    p = plan_placement(hosts, gpus, layout=layout, tp=tp, pp=pp, server_tp=stp, rollout_nodes=roll)
    for h in p.hosts:
        gpu_ids = [g for s in h.servers for g in s.gpus]
        ports = [s.port for s in h.servers] + ([h.router_port] if h.router_port else [])
        assert len(gpu_ids) == len(set(gpu_ids)) and set(gpu_ids) <= set(range(gpus))
        assert len(ports) == len(set(ports))
    owned = [p.owned_servers(r) for r in range(p.world_size)]
    urls = [u for h in p.hosts for u in h.server_urls()]
    assert sorted(itertools.chain(*owned)) == sorted(urls)  # every server owned, exactly once
    ranks = [r for h in p.hosts for r in h.trainer_ranks]
    assert ranks == list(range(p.world_size))


@pytest.mark.parametrize("kw, words", [
    (dict(layout="mixed"), "rollout.sglang.mode"),
    (dict(layout="colocated", server_tp=3), "rollout.sglang.tp_size=3"),
    (dict(layout="disaggregated", rollout_nodes=2), "MEGATRON_RL_ROLLOUT_NODES"),
    (dict(layout="colocated", rollout_nodes=1), "only the disaggregated"),
    (dict(layout="colocated", tp=3), "tensor_model_parallel_size"),
    (dict(layout="colocated", pp=2), "pipeline stage 0"),  # stage 1 alone on host b: no IPC sender there
])
def test_bad_layouts_name_the_setting(kw, words):
    with pytest.raises(ValueError, match=words):
        plan_placement(["a", "b"], 2, **kw)


def test_json_keys_are_the_documented_ones():
    d = json.loads(plan_placement(["a"], 1, layout="colocated").to_json())
    assert list(d) == ["layout", "hosts", "transport_owners", "world_size"]
    assert list(d["hosts"][0]) == ["host", "trainer_ranks", "servers", "router"]


def test_each_rank_gets_the_sglang_settings_of_its_role():
    from megatron_rl.loop.build import sglang_config_for
    from megatron_rl.config import load_config
    from megatron_rl.cluster.placement import placement_for_config

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.base_port=32000"])
    p = placement_for_config(cfg, ["a", "b"], 2)  # colocated, DP 4: owners 0 and 2
    owner_b = sglang_config_for(cfg, p, 2)
    assert (owner_b.host, owner_b.base_port, owner_b.num_servers, owner_b.server_urls) == ("b", 32000, 2, [])
    client_b = sglang_config_for(cfg, p, 3)
    assert client_b.server_urls == ["http://b:32001", "http://b:32000"] and client_b.router_url == ""  # its GPU first
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                             "rollout.sglang.weight_transport=nccl"])
    p = placement_for_config(cfg, ["r", "t"], 2, rollout_nodes=1)
    owner = sglang_config_for(cfg, p, 0)
    assert owner.server_urls == ["http://r:30000", "http://r:30001"] and owner.router_url == "http://r:30999"
    assert owner.nccl_master_addr == "t" and sglang_config_for(cfg, p, 1).server_urls == owner.server_urls


@pytest.mark.parametrize("tp, cp, pp, expected", [
    # by hand, Megatron's order (tp fastest, then cp, dp, pp), 8 ranks on 2 hosts of 4 GPUs:
    # (tp, cp, dp, pp) of ranks 0..7
    (2, 1, 2, [(0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, 0), (1, 0, 1, 0),
               (0, 0, 0, 1), (1, 0, 0, 1), (0, 0, 1, 1), (1, 0, 1, 1)]),
    (2, 2, 1, [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0),
               (0, 0, 1, 0), (1, 0, 1, 0), (0, 1, 1, 0), (1, 1, 1, 0)]),
])
def test_rank_coordinates_follow_megatrons_order(tp, cp, pp, expected):
    if pp == 1:
        p = plan_placement(["a", "b"], 4, layout="colocated", tp=tp, cp=cp)
    else:  # colocated needs pipeline stage 0 on every host: the servers on a host of their own
        p = plan_placement(["r", "a", "b"], 4, layout="disaggregated", tp=tp, cp=cp, pp=pp, rollout_nodes=1)
    got = [p.coords(r) for r in range(8)]
    assert [(c["tp"], c["cp"], c["dp"], c["pp"]) for c in got] == expected
    assert all(type(v) is int for c in got for v in c.values())  # ranks, not floats
    heads = [r for r in range(8) if p.is_replica_head(r)]
    assert heads == [r for r, (t, c, _, s) in enumerate(expected) if t == c == s == 0]


def test_the_configs_parallel_and_server_settings_reach_the_plan():
    from megatron_rl.cluster.placement import placement_for_config
    from megatron_rl.config import load_config

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                             "rollout.sglang.weight_transport=nccl", "rollout.sglang.tp_size=2",
                             "rollout.sglang.base_port=31000", "rollout.sglang.router_port=31500",
                             "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])
    p = placement_for_config(cfg, ["r", "t1", "t2"], 4, rollout_nodes=1)
    assert (p.layout, p.world_size, p.gpus_per_node, p.tp, p.cp, p.pp) == ("disaggregated", 8, 4, 2, 1, 2)
    assert [s.gpus for s in p.hosts[0].servers] == [(0, 1), (2, 3)]  # servers of rollout.sglang.tp_size GPUs
    assert [s.port for s in p.hosts[0].servers] == [31000, 31001] and p.hosts[0].router_port == 31500
    assert placement_for_config(load_config(None, []), ["a"], 2).layout == "embedded"  # the torch engine


@pytest.mark.parametrize("hosts, gpus, kw, message", [
    ([], 2, dict(layout="colocated"), "hosts []: need at least one host, each named once"),
    (["a", "a"], 2, dict(layout="colocated"), "hosts ['a', 'a']: need at least one host, each named once"),
    (["a"], 0, dict(layout="colocated"), "gpus per node must be >= 1, got 0"),
    (["r", "t"], 2, dict(layout="disaggregated"),
     "rollout nodes = 0: disaggregated needs between 1 and 1 of the 2 nodes for SGLang "
     "(MEGATRON_RL_ROLLOUT_NODES / --rollout-nodes)"),
    (["a", "b", "c"], 1, dict(layout="embedded", pp=2),
     "world size 3 (3 trainer nodes x 1 GPUs) is not divisible by parallel.tensor_model_parallel_size x "
     "context_parallel_size x pipeline_model_parallel_size = 2"),
    (["a", "b", "c"], 1, dict(layout="embedded", cp=2),
     "world size 3 (3 trainer nodes x 1 GPUs) is not divisible by parallel.tensor_model_parallel_size x "
     "context_parallel_size x pipeline_model_parallel_size = 2"),
    (["a", "b"], 2, dict(layout="colocated", pp=2),
     "colocated servers on b have no rank of pipeline stage 0 with tp = cp = 0 to send them weights (CUDA IPC "
     "is node-local): keep pipeline stage 0 of a replica on every node or use the disaggregated layout"),
])
def test_bad_plans_are_refused_with_the_whole_reason(hosts, gpus, kw, message):
    with pytest.raises(ValueError) as err:
        plan_placement(hosts, gpus, **kw)
    assert str(err.value) == message


def test_the_torch_engine_ignores_the_sglang_server_size():
    assert plan_placement(["a"], 2, layout="embedded", server_tp=3).transport_owners == (0, 1)


def test_a_rank_outside_the_world_is_named():
    with pytest.raises(ValueError) as err:
        plan_placement(["a", "b"], 4, layout="colocated").host_of(8)
    assert str(err.value) == "rank 8 is outside the world of 8 trainer ranks"
