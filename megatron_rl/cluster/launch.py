"""Multi-node launch: Slurm's environment -> the placement plan -> this host's trainer ranks or servers.

The sbatch scripts (slurm/) run two kinds of srun steps, one task per host each:

    python -m megatron_rl.cluster.launch --role serve CONFIG [overrides]   # disaggregated rollout hosts
    python -m megatron_rl.cluster.launch --role train CONFIG [overrides]   # trainer hosts: torchrun

and `megatron-rl launch --dry-run CONFIG [overrides] [--nodes N --gpus-per-node G]` prints the plan
both compute (megatron_rl.cluster.placement). The trainer ranks recompute the same plan from the same
environment in loop/build.py, so the plan printed is the plan executed.

World settings, from the environment or the flags: SLURM_JOB_NODELIST (hosts; the step's own
SLURM_STEP_NODELIST is never used: every step must see the whole job), SLURMD_NODENAME (this host),
MEGATRON_RL_GPUS_PER_NODE (else SLURM_GPUS_ON_NODE, else 8), MEGATRON_RL_ROLLOUT_NODES
(disaggregated: the first N hosts serve), MEGATRON_RL_MASTER_PORT (29500), MEGATRON_RL_MODEL (the
checkpoint disaggregated servers load; default model.hf_dir). The servers' API key is read from the
variable named by rollout.sglang.api_key_env.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from megatron_rl.config import RunConfig, load_config
from megatron_rl.cluster.placement import Placement, placement_for_config

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


def world_from_env(env: dict[str, str], nodes: int | None = None, gpus_per_node: int | None = None,
                   rollout_nodes: int | None = None) -> tuple[list[str], int, int]:
    """(hosts, GPUs per host, rollout hosts): flags first, then Slurm's and the scripts' variables."""
    if "SLURM_JOB_NODELIST" in env:
        hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
        if nodes is not None and nodes != len(hosts):
            raise ValueError(f"--nodes {nodes} but SLURM_JOB_NODELIST has {len(hosts)} hosts")
    else:
        hosts = [f"node{i}" for i in range(nodes or 1)]
    gpus = gpus_per_node or int(env.get("MEGATRON_RL_GPUS_PER_NODE") or _gpus_on_node(env) or 8)
    rollout = rollout_nodes if rollout_nodes is not None else int(env.get("MEGATRON_RL_ROLLOUT_NODES") or 0)
    return hosts, gpus, rollout


def _gpus_on_node(env: dict[str, str]) -> int:
    value = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE", "")
    return int(value.rpartition(":")[2]) if value else 0  # "h100:8" -> 8


def placement_for_run(cfg: RunConfig, world_size: int, env: dict[str, str] | None = None) -> Placement:
    """The plan a trainer rank executes: the one `--role train` resolved and exported (MEGATRON_RL_HOSTS,
    MEGATRON_RL_GPUS_PER_NODE, MEGATRON_RL_ROLLOUT_NODES), else one host with every rank on it."""
    env = dict(os.environ) if env is None else env
    if env.get("MEGATRON_RL_HOSTS"):
        plan = placement_for_config(cfg, env["MEGATRON_RL_HOSTS"].split(","), int(env["MEGATRON_RL_GPUS_PER_NODE"]),
                                    int(env.get("MEGATRON_RL_ROLLOUT_NODES") or 0))
    else:
        plan = placement_for_config(cfg, [cfg.rollout.sglang.host], world_size)
    if plan.world_size != world_size:
        raise ValueError(f"the placement plan has {plan.world_size} trainer ranks but torch.distributed "
                         f"started {world_size}")
    return plan


def plan_env(plan: Placement) -> dict[str, str]:
    """What a trainer rank needs to recompute `plan` (placement_for_run)."""
    rollout = len(plan.server_hosts) if plan.layout == "disaggregated" else 0
    return {"MEGATRON_RL_HOSTS": ",".join(h.host for h in plan.hosts),
            "MEGATRON_RL_GPUS_PER_NODE": str(plan.gpus_per_node), "MEGATRON_RL_ROLLOUT_NODES": str(rollout)}


def this_host(plan: Placement, env: dict[str, str]) -> str:
    host = env.get("SLURMD_NODENAME") or plan.hosts[int(env.get("SLURM_NODEID", "0"))].host
    if host not in [h.host for h in plan.hosts]:
        raise ValueError(f"this host {host!r} is not in the job's hosts {[h.host for h in plan.hosts]}")
    return host


# ---- trainer hosts --------------------------------------------------------------------------

def trainer_argv(plan: Placement, host: str, config: str, overrides: list[str], master_port: int = 29500) -> list[str]:
    """torchrun (cluster/torchrun.py: its first node leaves last) for this trainer host: ranks
    host_index * G .. + G - 1, as the plan numbers them."""
    trainers = [h.host for h in plan.trainer_hosts()]
    return [sys.executable, "-m", "megatron_rl.cluster.torchrun", f"--nnodes={len(trainers)}",
            f"--node-rank={trainers.index(host)}", f"--nproc-per-node={plan.gpus_per_node}",
            f"--master-addr={plan.master_addr}", f"--master-port={master_port}", "--local-addr", host,
            "-m", "megatron_rl.train", config, *overrides]


# ---- disaggregated rollout hosts -------------------------------------------------------------

def serve_argvs(plan: Placement, host: str, cfg: RunConfig, model: str, api_key: str) -> list[list[str]]:
    """The launch commands of this host's servers (+ the router on the router host), in order."""
    from megatron_rl.rollout import _sglang
    from megatron_rl.rollout.sglang_server import dist_ports, router_args, server_args, server_seed

    entry = next(h for h in plan.hosts if h.host == host)
    sg = replace(cfg.rollout.sglang, host=host, tp_size=len(entry.servers[0].gpus) if entry.servers else 1)
    first, http = plan.first_server_index(host), [s.port for s in entry.servers]
    argvs = [_sglang.server_argv(server_args(sg, model, s.port, s.gpus[0], server_seed(cfg.train.seed, first + i), d)
                                 + ["--api-key", api_key], sg.server_command)
             for i, (s, d) in enumerate(zip(entry.servers, dist_ports(sg, http)))]
    if entry.router_port is not None:  # every worker requires the key, so the router sends it
        urls = [u for h in plan.server_hosts for u in h.server_urls()]
        argvs.append(_sglang.router_argv(router_args(replace(sg, router_port=entry.router_port), urls)
                                         + ["--api-key", api_key], sg.router_command))
    return argvs


def serve_model(cfg: RunConfig, env: dict[str, str]) -> str:
    """The checkpoint disaggregated servers load: MEGATRON_RL_MODEL, else rollout.sglang.model_path,
    else model.hf_dir. An FP8 rollout needs a block-FP8 checkpoint made beforehand
    (tools/convert_hf_to_fp8.py): the trainer's own conversion runs after these servers start."""
    model = env.get("MEGATRON_RL_MODEL") or cfg.rollout.sglang.model_path
    if not model and cfg.precision.rollout_quant == "fp8_blockwise":
        raise ValueError("precision.rollout_quant=fp8_blockwise on disaggregated servers needs a block-FP8 "
                         "checkpoint: set rollout.sglang.model_path (or MEGATRON_RL_MODEL) to the output "
                         "of tools/convert_hf_to_fp8.py")
    model = model or cfg.model.hf_dir
    if not model:
        raise ValueError("disaggregated servers need a checkpoint: set MEGATRON_RL_MODEL or model.hf_dir")
    return model


def serve(argvs: list[list[str]], log_dir: Path, host: str) -> int:
    """Run this host's servers until SIGTERM (the job script stops the step when the trainer ends).

    A server or router that exits ends the step with status 1 and the job script then stops the
    trainer: a restarted server would hold the checkpoint's weights and would not be a member of the
    owner's NCCL weight group, so the next update could not reach it. Resume from the last checkpoint.
    """
    from megatron_rl.rollout.sglang_server import ManagedProcess, launch_env

    (log_dir / host).mkdir(parents=True, exist_ok=True)  # one folder per host, as the colocated owners
    procs = [ManagedProcess(a, launch_env(), log_dir / host / f"{_name(a, i)}.log") for i, a in enumerate(argvs)]
    stop = _stop_flag()
    for p in procs:
        p.start()
    try:
        while not stop:
            time.sleep(0.5)
            dead = [_name(p.argv, i) for i, p in enumerate(procs) if not p.alive()]
            if dead and not stop:
                print(f"{host}: {dead[0]} exited (see {log_dir / host}); ending the serve step", file=sys.stderr)
                return 1
        return 0
    finally:
        for p in procs:
            p.stop(timeout_s=20.0)


def _name(argv: list[str], index: int) -> str:
    port = argv[argv.index("--port") + 1] if "--port" in argv else str(index)
    return f"router-{port}" if any("router" in a for a in argv[:3]) else f"server-{port}"


def _stop_flag() -> list[int]:
    """A list that becomes non-empty on SIGTERM / SIGINT (srun forwards them to the step's tasks)."""
    flag: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: flag.append(signum))
    return flag


def run_trainer(argv: list[str], env: dict[str, str]) -> int:
    """torchrun as a child in its own session, so a SIGTERM to this task ends it and its ranks
    (torchrun forwards the signal to the ranks) before we exit with its status."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signal.SIGTERM))
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- entry -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl launch", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--dry-run", action="store_true", help="print the placement plan as JSON and exit")
    parser.add_argument("--role", choices=("train", "serve"), help="what this srun task runs (slurm/*.sbatch)")
    parser.add_argument("--nodes", type=int, help="hosts in the job (default: SLURM_JOB_NODELIST)")
    parser.add_argument("--gpus-per-node", type=int, help="default MEGATRON_RL_GPUS_PER_NODE / SLURM_GPUS_ON_NODE / 8")
    parser.add_argument("--rollout-nodes", type=int, help="disaggregated: hosts for SGLang (MEGATRON_RL_ROLLOUT_NODES)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    try:
        cfg = load_config(args.config, args.overrides)
        plan = placement_for_config(cfg, *world_from_env(env, args.nodes, args.gpus_per_node, args.rollout_nodes))
        host = this_host(plan, env) if args.role and not args.dry_run else ""
        if args.role == "serve" and not args.dry_run:
            argvs = serve_argvs(plan, host, cfg, serve_model(cfg, env), cfg.rollout.sglang.api_key())
    except ValueError as err:
        print(f"megatron-rl launch: error: {err}", file=sys.stderr)
        return 2
    if not host:
        print(plan.to_json())
        return 0
    if args.role == "serve":
        return serve(argvs, Path(env.get("MEGATRON_RL_LOG_DIR") or Path(cfg.log.dir) / "sglang"), host)
    port = int(env.get("MEGATRON_RL_MASTER_PORT", "29500"))
    return run_trainer(trainer_argv(plan, host, args.config, args.overrides, port), {**env, **plan_env(plan)})


if __name__ == "__main__":
    sys.exit(main())
