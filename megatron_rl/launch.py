"""Multi-node launcher: Slurm's environment -> trainer ranks (torchrun) and SGLang rollout servers.

One `srun --ntasks-per-node=1 python -m megatron_rl.launch CONFIG [key=value ...]` per job. Every
node computes the same plan from SLURM_JOB_NODELIST and takes its own part:

- colocated: every node is a trainer node and also runs gpus_per_node / tp_size SGLang servers on
  its own GPUs (memory released while training), bound to the node's cluster address;
- disaggregated: the first `rollout_nodes` nodes run SGLang servers (and, on the first of them,
  sglang-router); the other nodes run the trainer (torchrun, NCCL), whose rank 0 broadcasts weights.

Settings come from the environment (the sbatch scripts set them):
MEGATRON_RL_LAYOUT (colocated | disaggregated), MEGATRON_RL_ROLLOUT_NODES, MEGATRON_RL_SGLANG_TP,
MEGATRON_RL_GPUS_PER_NODE (default SLURM_GPUS_ON_NODE or 8), MEGATRON_RL_MASTER_PORT (29500),
MEGATRON_RL_SGLANG_PORT (30000), MEGATRON_RL_ROUTER_PORT (30999), MEGATRON_RL_MODEL (checkpoint the
servers load). The API key is read by the servers and the trainer from MEGATRON_RL_SGLANG_API_KEY.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

LAYOUTS = ("colocated", "disaggregated")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm hostlist syntax -> host names: "gpu[01-03,07],login1" -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        hosts.extend(_expand_one(item))
    return hosts


def _expand_one(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    out = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        width = len(lo)
        for i in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand_one(f"{head}{i:0{width}d}{tail}"))
    return out


@dataclass(frozen=True)
class Plan:
    """What every node of the job does. Server URLs are http://host:port."""

    layout: str
    nodes: list[str]
    gpus_per_node: int
    tp_size: int
    trainer_nodes: list[str]
    rollout_nodes: list[str]
    master_port: int = 29500
    server_port: int = 30000
    router_port: int = 30999
    server_urls: dict[str, list[str]] = field(default_factory=dict)

    @property
    def master_addr(self) -> str:
        return self.trainer_nodes[0]

    @property
    def router_url(self) -> str:
        return f"http://{self.rollout_nodes[0]}:{self.router_port}" if self.layout == "disaggregated" else ""

    def servers_of(self, node: str) -> list[str]:
        return self.server_urls.get(node, [])


def make_plan(nodes: list[str], layout: str, gpus_per_node: int, tp_size: int, rollout_nodes: int = 0,
              master_port: int = 29500, server_port: int = 30000, router_port: int = 30999) -> Plan:
    """Assign nodes to trainer / rollout and servers to GPUs; ValueError naming the bad setting."""
    if layout not in LAYOUTS:
        raise ValueError(f"MEGATRON_RL_LAYOUT={layout!r} is not one of {list(LAYOUTS)}")
    if tp_size < 1 or gpus_per_node % tp_size:
        raise ValueError(f"MEGATRON_RL_SGLANG_TP={tp_size} must divide the {gpus_per_node} GPUs per node")
    if layout == "colocated":
        trainer, rollout = list(nodes), list(nodes)
    else:
        if not 0 < rollout_nodes < len(nodes):
            raise ValueError(f"MEGATRON_RL_ROLLOUT_NODES={rollout_nodes}: disaggregated needs between 1 and "
                             f"{len(nodes) - 1} rollout nodes out of {len(nodes)}")
        rollout, trainer = list(nodes[:rollout_nodes]), list(nodes[rollout_nodes:])
    per_node = gpus_per_node // tp_size
    urls = {n: [f"http://{n}:{server_port + i}" for i in range(per_node)] for n in rollout}
    return Plan(layout, list(nodes), gpus_per_node, tp_size, trainer, rollout, master_port, server_port,
                router_port, urls)


def plan_from_env(env: dict[str, str]) -> Plan:
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    gpus = int(env.get("MEGATRON_RL_GPUS_PER_NODE") or env.get("SLURM_GPUS_ON_NODE") or 8)
    return make_plan(nodes, env.get("MEGATRON_RL_LAYOUT", "colocated"), gpus,
                     int(env.get("MEGATRON_RL_SGLANG_TP", "1")), int(env.get("MEGATRON_RL_ROLLOUT_NODES", "0")),
                     int(env.get("MEGATRON_RL_MASTER_PORT", "29500")), int(env.get("MEGATRON_RL_SGLANG_PORT", "30000")),
                     int(env.get("MEGATRON_RL_ROUTER_PORT", "30999")))


def trainer_argv(plan: Plan, node: str, config: str, overrides: list[str]) -> list[str]:
    """torchrun for this trainer node, with the rollout settings the plan decided as overrides."""
    node_rank = plan.trainer_nodes.index(node)
    sglang = [f"rollout.sglang.mode={plan.layout}", f"rollout.sglang.tp_size={plan.tp_size}"]
    if plan.layout == "colocated":
        sglang += [f"rollout.sglang.host={node}", f"rollout.sglang.base_port={plan.server_port}",
                   f"rollout.sglang.num_servers={plan.gpus_per_node // plan.tp_size}"]
    else:
        urls = ",".join(u for n in plan.rollout_nodes for u in plan.servers_of(n))
        sglang += [f"rollout.sglang.server_urls=[{urls}]", f"rollout.sglang.router_url={plan.router_url}",
                   f"rollout.sglang.nccl_master_addr={plan.master_addr}"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(plan.trainer_nodes)}",
            f"--node-rank={node_rank}", f"--nproc-per-node={plan.gpus_per_node}",
            f"--master-addr={plan.master_addr}", f"--master-port={plan.master_port}",
            "-m", "megatron_rl.train", config, "rollout.engine=sglang", *sglang, *overrides]


def rollout_argvs(plan: Plan, node: str, model: str, api_key: str, sglang=None) -> list[list[str]]:
    """sglang.launch_server per TP group of this rollout node (+ the router on the first one).

    sglang: the run's `rollout.sglang` section (kv_cache_dtype, mem_fraction_static, quantization,
    extra_args, commands...); the plan decides only placement (host, ports, TP size)."""
    import dataclasses

    from megatron_rl.rollout import _sglang
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_server import router_args, server_args

    cfg = dataclasses.replace(sglang or SGLangConfig(), mode="disaggregated", host=node, tp_size=plan.tp_size,
                              weight_transport="nccl", router_port=plan.router_port)
    argvs = [_sglang.server_argv(server_args(cfg, model, plan.server_port + i, i * plan.tp_size, seed=i)
                                 + ["--api-key", api_key], cfg.server_command)
             for i in range(plan.gpus_per_node // plan.tp_size)]
    if node == plan.rollout_nodes[0]:
        all_urls = [u for n in plan.rollout_nodes for u in plan.servers_of(n)]
        argvs.append(_sglang.router_argv(router_args(cfg, all_urls) + ["--api-key", api_key], cfg.router_command))
    return argvs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m megatron_rl.launch CONFIG.yaml [section.key=value ...]")
    env = dict(os.environ)
    plan = plan_from_env(env)
    node = plan.nodes[int(env.get("SLURM_NODEID", "0"))]
    if plan.layout == "disaggregated" and node in plan.rollout_nodes:
        model, key = env["MEGATRON_RL_MODEL"], env["MEGATRON_RL_SGLANG_API_KEY"]
        from megatron_rl.config import load_config

        sglang = load_config(argv[0], argv[1:]).rollout.sglang
        procs = [subprocess.Popen(a) for a in rollout_argvs(plan, node, model, key, sglang)]
        return max(p.wait() for p in procs)  # servers live until the job ends (scancel / time limit)
    return subprocess.call(trainer_argv(plan, node, argv[0], argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
