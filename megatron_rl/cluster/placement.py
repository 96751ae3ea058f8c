"""Placement plan of a job: which host runs which trainer ranks and SGLang servers, and who owns what.

Pure: config + world layout (hosts, GPUs per host, rollout hosts) -> `Placement`. The sbatch
scripts print it (`megatron-rl launch --dry-run`), `megatron_rl.cluster.launch` starts exactly its servers
and trainer ranks, and `loop/build.py` asks it which rank owns which servers.

Ownership (design.md section 10, "one owner per external resource"):

- colocated: each trainer host serves its own GPUs: servers of `tp` GPUs each, numbered from the
  node-local GPU 0 (base GPU id = i * tp) on ports base_port + i, so no two servers of a host share
  a GPU or a port. They are started, paused, updated and resumed by one rank of that host: the
  lowest rank there with tp = cp = pp = 0. Weights go by CUDA IPC, which is node-local, so that
  rank must be on the host; payloads are staged at pipeline stage 0 (sync/weight_sync.py relays the
  later stages there), so it must be a stage-0 rank.
- disaggregated: the first `rollout_nodes` hosts run only servers (started by the serve step of
  megatron_rl.cluster.launch) and the router (first rollout host, router_port). Global rank 0 (dp = tp =
  pp = 0) owns every server: pause / update / continue and rank 0 of the NCCL weight group. slime
  does the same per PP stage (update_weight_from_distributed.py, `_is_pp_src_rank`: dp = tp = 0);
  here the relay has staged every stage's payload at stage 0, so one group suffices.
- embedded (rollout.engine=torch): no servers; every data-parallel replica's first rank owns its
  in-process engine.

Every other data-parallel replica's first rank is a client: it generates its shard through the
servers (colocated: its host's; disaggregated: the router) and waits at a barrier while the owner
updates them. Rank numbering is Megatron's default order tp-cp-ep-dp-pp (tp fastest), over trainer
hosts in order, `gpus_per_node` ranks per host, as torchrun's --node-rank assigns them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

LAYOUTS = ("colocated", "disaggregated", "embedded")


@dataclass(frozen=True)
class ServerSlot:
    gpus: tuple[int, ...]
    """Node-local GPU ids of the server's TP group (base GPU id = gpus[0])."""
    port: int


@dataclass(frozen=True)
class HostPlan:
    host: str
    trainer_ranks: tuple[int, ...]
    servers: tuple[ServerSlot, ...] = ()
    router_port: int | None = None

    def server_urls(self) -> list[str]:
        return [f"http://{self.host}:{s.port}" for s in self.servers]


@dataclass(frozen=True)
class Placement:
    """The whole job. Predicates take global trainer ranks."""

    layout: str
    hosts: tuple[HostPlan, ...]
    world_size: int
    gpus_per_node: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    transport_owners: tuple[int, ...] = field(default=())

    # ---- where ranks live ------------------------------------------------------------------

    def host_of(self, rank: int) -> HostPlan:
        for h in self.hosts:
            if rank in h.trainer_ranks:
                return h
        raise ValueError(f"rank {rank} is outside the world of {self.world_size} trainer ranks")

    def local_rank(self, rank: int) -> int:
        return self.host_of(rank).trainer_ranks.index(rank)

    def coords(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) ranks of `rank` in Megatron's tp-cp-ep-dp-pp order."""
        dp = self.world_size // (self.tp * self.cp * self.pp)
        return {"tp": rank % self.tp, "cp": rank // self.tp % self.cp,
                "dp": rank // (self.tp * self.cp) % dp, "pp": rank // (self.tp * self.cp * dp)}

    def is_replica_head(self, rank: int) -> bool:
        """First rank of its data-parallel replica: the rank that samples (loop/phases.generate)."""
        c = self.coords(rank)
        return c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0

    # ---- who owns what ---------------------------------------------------------------------

    @property
    def server_hosts(self) -> list[HostPlan]:
        return [h for h in self.hosts if h.servers]

    @property
    def router_url(self) -> str:
        routed = [h for h in self.hosts if h.router_port is not None]
        return f"http://{routed[0].host}:{routed[0].router_port}" if routed else ""

    def is_owner(self, rank: int) -> bool:
        """Starts (colocated), pauses, updates and resumes its server set, or its embedded engine."""
        return rank in self.transport_owners

    def rollout_role(self, rank: int) -> str | None:
        """"owner" | "client" (samples through servers it does not own) | None (gets samples by
        broadcast from its replica head)."""
        if self.is_owner(rank):
            return "owner"
        return "client" if self.is_replica_head(rank) else None

    def servers_for(self, rank: int) -> list[str]:
        """URLs a replica head samples from: its host's servers (colocated) or all of them.

        Colocated, in this head's order of preference: the host's servers rotated so that head j of
        the host's k heads starts at server j * n // k (its own GPUs' server when n = k). The engine
        sends to the least busy server by its own counters, ties to the first: without the rotation
        every head, seeing 0 everywhere, sent its rollout to server 0 and the other GPUs idled."""
        if self.layout == "colocated":
            host = self.host_of(rank)
            urls = host.server_urls()
            heads = [r for r in host.trainer_ranks if self.is_replica_head(r)]
            if not urls or rank not in heads:
                return urls
            start = heads.index(rank) * len(urls) // len(heads)
            return urls[start:] + urls[:start]
        return [u for h in self.server_hosts for u in h.server_urls()]

    def first_server_index(self, host: str) -> int:
        """The job-wide index of `host`'s first server (servers numbered host by host, in plan
        order): server i of the host is number first + i, which sets its --random-seed."""
        index = 0
        for h in self.hosts:
            if h.host == host:
                return index
            index += len(h.servers)
        raise ValueError(f"host {host!r} is not in the placement")

    def owned_servers(self, rank: int) -> list[str]:
        return self.servers_for(rank) if self.is_owner(rank) and self.layout != "embedded" else []

    def starts_servers(self, rank: int) -> bool:
        """Colocated: the owner launches its host's servers. Disaggregated servers are started by
        the serve step of megatron_rl.cluster.launch, never by a trainer rank."""
        return self.layout == "colocated" and self.is_owner(rank)

    def trainer_hosts(self) -> list[HostPlan]:
        return [h for h in self.hosts if h.trainer_ranks]

    @property
    def master_addr(self) -> str:
        """Host of global rank 0: torch.distributed rendezvous and the NCCL weight group's rank 0."""
        return self.trainer_hosts()[0].host

    # ---- output ----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        hosts = [{"host": h.host, "trainer_ranks": list(h.trainer_ranks),
                  "servers": [{"gpus": list(s.gpus), "port": s.port} for s in h.servers],
                  "router": None if h.router_port is None else {"port": h.router_port}}
                 for h in self.hosts]
        return {"layout": self.layout, "hosts": hosts, "transport_owners": list(self.transport_owners),
                "world_size": self.world_size}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def plan_placement(hosts: list[str], gpus_per_node: int, *, layout: str, tp: int = 1, cp: int = 1, pp: int = 1,
                   server_tp: int = 1, rollout_nodes: int = 0, base_port: int = 30000,
                   router_port: int = 30999) -> Placement:
    """Place trainer ranks and servers on `hosts`; ValueError naming the offending setting.

    layout: colocated | disaggregated | embedded; tp/cp/pp: the trainer's parallel sizes;
    server_tp: GPUs per SGLang server; rollout_nodes: hosts given to servers (disaggregated).
    """
    _check_layout(hosts, gpus_per_node, layout, server_tp, rollout_nodes)
    serving = hosts[:rollout_nodes] if layout == "disaggregated" else (hosts if layout == "colocated" else [])
    training = hosts[rollout_nodes:] if layout == "disaggregated" else hosts
    world = gpus_per_node * len(training)
    if world % (tp * cp * pp):
        raise ValueError(f"world size {world} ({len(training)} trainer nodes x {gpus_per_node} GPUs) is not "
                         f"divisible by parallel.tensor_model_parallel_size x context_parallel_size x "
                         f"pipeline_model_parallel_size = {tp * cp * pp}")
    slots = tuple(ServerSlot(tuple(range(i * server_tp, (i + 1) * server_tp)), base_port + i)
                  for i in range(gpus_per_node // server_tp))
    plans = []
    for h in hosts:
        ranks = tuple(range(training.index(h) * gpus_per_node, (training.index(h) + 1) * gpus_per_node)) \
            if h in training else ()
        router = router_port if layout == "disaggregated" and h == hosts[0] else None
        plans.append(HostPlan(h, ranks, slots if h in serving else (), router))
    placement = Placement(layout, tuple(plans), world, gpus_per_node, tp, cp, pp)
    return _with_owners(placement)


def _check_layout(hosts: list[str], gpus_per_node: int, layout: str, server_tp: int, rollout_nodes: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {list(LAYOUTS)} (rollout.sglang.mode)")
    if not hosts or len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts {hosts}: need at least one host, each named once")
    if gpus_per_node < 1:
        raise ValueError(f"gpus per node must be >= 1, got {gpus_per_node}")
    if layout != "embedded" and (server_tp < 1 or gpus_per_node % server_tp):
        raise ValueError(f"rollout.sglang.tp_size={server_tp} must divide the {gpus_per_node} GPUs per node")
    if layout == "disaggregated" and not 0 < rollout_nodes < len(hosts):
        raise ValueError(f"rollout nodes = {rollout_nodes}: disaggregated needs between 1 and {len(hosts) - 1} "
                         f"of the {len(hosts)} nodes for SGLang (MEGATRON_RL_ROLLOUT_NODES / --rollout-nodes)")
    if layout != "disaggregated" and rollout_nodes:
        raise ValueError(f"rollout nodes = {rollout_nodes}: only the disaggregated layout gives servers own nodes")


def _with_owners(p: Placement) -> Placement:
    heads = [r for r in range(p.world_size) if p.is_replica_head(r)]
    if p.layout == "embedded":
        owners = heads
    elif p.layout == "disaggregated":
        owners = [0]
    else:
        owners = []
        for h in p.hosts:
            local = [r for r in h.trainer_ranks if r in heads]
            if not local:
                raise ValueError(f"colocated servers on {h.host} have no rank of pipeline stage 0 with tp = cp = 0 "
                                 "to send them weights (CUDA IPC is node-local): keep pipeline stage 0 of a "
                                 "replica on every node or use the disaggregated layout")
            owners.append(local[0])
    return Placement(p.layout, p.hosts, p.world_size, p.gpus_per_node, p.tp, p.cp, p.pp, tuple(owners))


def placement_for_config(cfg, hosts: list[str], gpus_per_node: int, rollout_nodes: int = 0) -> Placement:
    """The plan of a RunConfig on `hosts`: layout from rollout.engine / rollout.sglang.mode."""
    sg, par = cfg.rollout.sglang, cfg.parallel
    layout = sg.mode if cfg.rollout.engine == "sglang" else "embedded"
    return plan_placement(hosts, gpus_per_node, layout=layout, tp=par.tensor_model_parallel_size,
                          cp=par.context_parallel_size, pp=par.pipeline_model_parallel_size,
                          server_tp=sg.tp_size, rollout_nodes=rollout_nodes, base_port=sg.base_port,
                          router_port=sg.router_port)
