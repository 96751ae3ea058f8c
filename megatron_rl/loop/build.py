"""Build every component of a run from its config: parallel state, data, actor, engine, sync, logs."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from megatron_rl import collectives
from megatron_rl.config import RunConfig, save_config
from megatron_rl.convert.gguf_to_hf import cached_hf_dir
from megatron_rl.cluster.launch import placement_for_run
from megatron_rl.cluster.placement import Placement

log = logging.getLogger("megatron_rl.loop.build")


@dataclass
class Run:
    """Everything the loop touches. `engine` and the transport exist on the engine rank only."""

    cfg: RunConfig
    parallel: Any
    tokenizer: Any
    loader: Any
    actor: Any
    engine: Any
    sync: Any
    rewards: Any
    controller: Any
    logger: Any
    checkpointer: Any
    reward_stats: dict[str, float] = field(default_factory=dict)
    host_groups: Any = None
    """collectives.HostGroups: gloo twins of the model-parallel / data-parallel groups for long waits."""
    ref: Any = None
    """The frozen reference policy (a MegatronActor built with frozen=True) when a KL term needs it."""
    kv_calibration: Any = None
    """actor.kv_amax.KvCalibration (FP8 KV cache, kv_scales=calibrated): fed by the old-log-prob pass."""

    @property
    def is_engine_rank(self) -> bool:
        return self.parallel.tp_rank == 0 and self.parallel.pp_rank == 0

    @property
    def is_log_rank(self) -> bool:
        return self.parallel.rank == 0

    def resume_step(self) -> int:
        if self.cfg.checkpoint.resume is not True:  # preflight.prepare_run resolved `auto` (run_folder.py)
            return 0
        return self.checkpointer.load_latest(self)

    def plant_outliers(self) -> None:
        """model.outlier_channels > 0: plant the outliers (actor/outliers.py). Call on a fresh start
        only, before the first weight sync, so the engine and every checkpoint get planted weights."""
        m = self.cfg.model
        if m.outlier_channels:
            channels = self.actor.plant_outliers(m.outlier_channels, m.outlier_scale, seed=self.cfg.train.seed)
            if self.is_log_rank:
                log.info("planted activation outliers x%g in hidden channels %s", m.outlier_scale, channels)

    def save_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_every
        last = step == self.cfg.train.num_steps - 1
        return bool(every and (step + 1) % every == 0) or (last and self.cfg.checkpoint.save_final)

    def maybe_save(self, step: int) -> None:
        if self.save_due(step):
            self.checkpointer.save(self, step + 1)

    def hf_export_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_hf_every
        return bool(every) and (step + 1) % every == 0

    def export_hf(self, step: int) -> None:
        """checkpoint.save_hf_every: the weights after `step` as log.dir/hf/step_<step + 1>."""
        from megatron_rl.loop.hf_export import export_hf, hf_export_dir

        export_hf(self.actor, self.parallel, self.checkpointer.hf_dir, hf_export_dir(self.cfg.log.dir, step + 1))

    def finish(self) -> None:
        self.checkpointer.wait()  # an async save in flight is published before the run ends
        self.logger.close()
        if self.is_log_rank:
            log.info("summary\n%s", self.logger.summary())
            if self.cfg.log.plot and self.logger.history:
                from megatron_rl.telemetry.plotting import plot_runs
                png = plot_runs({Path(self.cfg.log.dir).name: self.logger.history},
                                Path(self.cfg.log.dir) / "curves.png",
                                title=f"{self.cfg.precision.train_recipe} "
                                      f"params={self.actor.settings.params_dtype} "
                                      f"calib={'on' if self.cfg.calib.enabled else 'off'}")
                log.info("curves written to %s", png)
        self.sync.close()  # before the engine stops its servers
        if self.engine is not None:
            self.engine.shutdown()
        self.rewards.close()


def build_fp8_recipe(cfg: RunConfig):
    from megatron_rl.fp8 import Fp8Recipe
    return Fp8Recipe.from_contract(cfg.precision.train_recipe, cfg.precision.fp8_format,
                                   amax_history_len=cfg.precision.amax_history_len)


def build_model_dir(cfg: RunConfig, parallel) -> Path:
    """The HF folder to start from: the user's, the GGUF's cached conversion, or the tiny
    warm-started one (both converted or built on rank 0)."""
    if cfg.model.gguf:
        if parallel.rank == 0:
            cached_hf_dir(cfg.model.gguf)
        collectives.barrier(None)  # the other ranks read what rank 0 wrote
        return cached_hf_dir(cfg.model.gguf)
    if cfg.model.hf_dir:
        path = Path(cfg.model.hf_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"config key 'model.hf_dir': no HF checkpoint (config.json) in {path}")
        return path
    from megatron_rl.loop.warmstart import prepare_tiny_model
    cache = Path(cfg.log.dir).parent / ".tiny_models"
    if parallel.rank == 0:
        prepare_tiny_model(cfg, cache)
    collectives.barrier(None)  # the other ranks read what rank 0 wrote
    return prepare_tiny_model(cfg, cache)


def _dataset_kwargs(data_cfg) -> dict:
    """PromptDataset keyword arguments of a `data` section: keys, length limit, prompt formatting."""
    from megatron_rl.data.datasets import PromptFormat

    d = data_cfg
    fmt = PromptFormat(apply_chat_template=d.chat_template, system_prompt=d.system_prompt,
                       template_kwargs=dict(d.template_kwargs), prompt_template=d.prompt_template)
    return dict(prompt_key=d.prompt_key, answer_key=d.answer_key, max_prompt_len=d.max_prompt_len, fmt=fmt)


def read_prompts(data_cfg, tokenizer, path: str = "", records: list | None = None):
    """A PromptDataset from a .jsonl / .parquet file or in-memory records, with a `data` section's
    keys, prompt formatting and length limit (training and evaluation share this path)."""
    from megatron_rl.data.datasets import PromptDataset

    kw = _dataset_kwargs(data_cfg)
    if records is not None:
        return PromptDataset.from_records(records, tokenizer, **kw)
    reader = PromptDataset.from_parquet if Path(path).suffix == ".parquet" else PromptDataset.from_jsonl
    return reader(str(path), tokenizer, **kw)


def build_dataset(data_cfg, tokenizer, seed: int):
    """The PromptDataset a `data` section describes (training and evaluation sets alike): the file
    at data_cfg.path, or the built-in task; keys, answers and prompt formatting from the section."""
    from megatron_rl.data.tasks import make_task_dataset

    d = data_cfg
    if not d.path:
        return read_prompts(d, tokenizer, records=make_task_dataset(d.task, d.num_examples, seed=seed))
    if not Path(d.path).is_file():
        raise ValueError(f"config key 'data.path': no such file {d.path}")
    return read_prompts(d, tokenizer, d.path)


def build_data(cfg: RunConfig, tokenizer, parallel):
    """The training loader. data.num_epochs > 0 caps train.num_steps at the batches it holds."""
    from megatron_rl.data.loader import PromptLoader

    dataset = build_dataset(cfg.data, tokenizer, cfg.train.seed)
    if cfg.data.prompts_per_step % parallel.dp_size:
        raise ValueError(f"config key 'data.prompts_per_step': {cfg.data.prompts_per_step} is not "
                         f"divisible by the data-parallel size {parallel.dp_size}")
    loader = PromptLoader(dataset, batch_size=cfg.data.prompts_per_step, seed=cfg.train.seed,
                          shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs)
    if loader.num_batches is not None and loader.num_batches < cfg.train.num_steps:
        if loader.num_batches == 0:
            raise ValueError(f"config key 'data.num_epochs': {cfg.data.num_epochs} epochs of {len(dataset)} "
                             f"prompts hold no full batch of data.prompts_per_step={cfg.data.prompts_per_step}")
        log.info("data.num_epochs=%d: %d steps (train.num_steps=%d capped)", cfg.data.num_epochs,
                 loader.num_batches, cfg.train.num_steps)
        cfg.train.num_steps = loader.num_batches
    return loader


def reward_name(cfg: RunConfig) -> str:
    """The run's reward function: reward.name, else the built-in task's, else math_verify."""
    from megatron_rl.data.tasks import get_task

    return cfg.reward.name or (get_task(cfg.data.task).reward_fn if not cfg.data.path else "math_verify")


def build_rewards(cfg: RunConfig, name: str = ""):
    """A reward runner of reward.num_workers processes: reward.url (HTTP, batched), a user or
    built-in reward.name, or the task's; `name` (an eval dataset's reward) in their place, batched
    only when it is reward.name itself."""
    from megatron_rl.rewards import HttpReward, RewardRunner, get_reward_fn

    r = cfg.reward
    if r.url and not name:
        remote = HttpReward(r.url, timeout_s=r.timeout_s, max_retries=r.max_retries, backoff_s=r.retry_backoff_s)
        # The worker's wait covers every attempt: the endpoint's own timeouts end the call first.
        return RewardRunner(remote, timeout_s=remote.max_budget_s() + 5.0, batched=True, num_workers=r.num_workers)
    name = name or reward_name(cfg)
    batched = r.batched and name == r.name
    return RewardRunner(get_reward_fn(name, batched=batched), timeout_s=r.timeout_s, batched=batched,
                        num_workers=r.num_workers)


def build_engine(cfg: RunConfig, model_dir: Path, placement: Placement | None = None, rank: int = 0):
    """The rollout engine and the transport that feeds it (the owner rank of `placement` only)."""
    if cfg.rollout.engine == "sglang":
        return build_sglang(cfg, model_dir, placement, rank)
    from megatron_rl.rollout.torch_engine import TorchRolloutEngine
    from megatron_rl.sync.transport import InProcessTransport

    p = cfg.precision
    engine = TorchRolloutEngine(model_dir, rollout_quant=p.rollout_quant,
                                weight_block_size=tuple(p.weight_block_size), scale_format=p.scale_format,
                                high_precision=tuple(p.high_precision), seed=cfg.train.seed,
                                kv_cache_dtype=cfg.rollout.kv_cache_dtype,
                                device="cuda" if torch.cuda.is_available() else "cpu")  # the trainer's GPU
    return engine, InProcessTransport(engine)


def sglang_config_for(cfg: RunConfig, placement: Placement | None, rank: int):
    """rollout.sglang as `placement` gives it to `rank`: the owner of colocated servers launches its
    host's slots (base GPU ids 0, tp, 2 tp, ... from the node-local GPU 0); everyone else attaches."""
    sg = cfg.rollout.sglang
    if placement is None:
        return sg
    host = placement.host_of(rank)
    if placement.starts_servers(rank):
        return replace(sg, host=host.host, base_port=host.servers[0].port, num_servers=len(host.servers),
                       server_urls=[], launch_router=False)
    router = placement.router_url if placement.layout == "disaggregated" else ""
    return replace(sg, server_urls=placement.servers_for(rank), router_url=router, launch_router=False,
                   nccl_master_addr=placement.master_addr if placement.layout == "disaggregated" else sg.nccl_master_addr)


def build_sglang(cfg: RunConfig, model_dir: Path, placement: Placement | None = None, rank: int = 0):
    """SGLang servers (launched or attached) and the configured weight transport.

    Colocated servers with TP > 1 need every rank of a server's GPU group to gather its payload
    (SGLangTensorTransport(gather=...)); this builder wires the single-sender layout."""
    from megatron_rl.rollout.sglang_checkpoint import (check_block_alignment, check_scale_format,
                                                       rollout_checkpoint, rollout_quant_spec)
    from megatron_rl.rollout.sglang_engine import SGLangEngine
    from megatron_rl.sync.disk_transport import DiskTransport
    from megatron_rl.sync.sglang_transport import SGLangNcclTransport, SGLangTensorTransport

    sg = sglang_config_for(cfg, placement, rank)
    spec = rollout_quant_spec(cfg)
    if sg.mode == "colocated" and torch.cuda.is_available():  # the servers share this GPU's architecture
        major, minor = torch.cuda.get_device_capability()
        check_scale_format(spec, 10 * major + minor)
    check_block_alignment(model_dir, spec)
    host = placement.host_of(rank).host if placement is not None else sg.host
    log_root = Path(os.environ.get("MEGATRON_RL_LOG_DIR") or Path(cfg.log.dir) / "sglang")
    # Launched servers are numbered over the job (their seeds differ on every host: server_seed).
    first = placement.first_server_index(host) if placement is not None and placement.starts_servers(rank) else 0
    engine = SGLangEngine(sg, rollout_checkpoint(cfg, model_dir), seed=cfg.train.seed + first,
                          log_dir=_mkdir(log_root / host))
    if placement is not None and not placement.is_owner(rank):
        return engine, None  # a client: samples through servers another rank pauses and updates
    if sg.weight_transport == "tensor":
        return engine, SGLangTensorTransport(engine, check=cfg.sync.check)
    if sg.weight_transport == "nccl":  # gloo on a CPU-only trainer (the servers' doubles join over gloo)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        return engine, SGLangNcclTransport(engine, sg.nccl_master_addr, sg.nccl_master_port, backend=backend,
                                           check=cfg.sync.check)
    return engine, DiskTransport(engine, sg.disk_dir, template_dir=model_dir)  # validated: disk needs disk_dir


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)  # one folder per host: server logs never collide
    return path


def build_rollout(cfg: RunConfig, model_dir: Path, parallel, host_groups=None):
    """(engine, transport, placement) of this rank. Owners build first (colocated: they start their
    host's servers); every rank then waits at a barrier, so clients attach to servers that are up.

    One process started without the launcher, disaggregated: it owns the servers its rollout.sglang
    section launches or lists (placement None), as a laptop or a single-host test runs them.
    The waits (a checkpoint conversion, a server start) run on the gloo world of `host_groups`,
    with the job's long-wait timeout, never on the default NCCL group."""
    if (cfg.rollout.engine == "sglang" and cfg.rollout.sglang.mode == "disaggregated"
            and parallel.world_size == 1 and not os.environ.get("MEGATRON_RL_HOSTS")):
        engine, transport = build_engine(cfg, model_dir)
        return engine, transport, None
    placement = placement_for_run(cfg, parallel.world_size)
    host, node = placement.host_of(parallel.rank).host, os.environ.get("SLURMD_NODENAME")
    if node and os.environ.get("MEGATRON_RL_HOSTS") and node != host:  # a plan from megatron_rl.cluster.launch
        raise ValueError(f"rank {parallel.rank} runs on node {node} but the placement plan puts it on {host} "
                         "(torchrun's --node-rank must follow the plan's host order)")
    role = placement.rollout_role(parallel.rank)
    world = host_groups.world if host_groups is not None else None
    if cfg.rollout.engine == "sglang":  # one conversion to the FP8 rollout checkpoint, before any owner reads it
        from megatron_rl.rollout.sglang_checkpoint import rollout_checkpoint

        if parallel.rank == 0:
            rollout_checkpoint(cfg, model_dir)
        collectives.barrier(world)
    engine, transport = build_engine(cfg, model_dir, placement, parallel.rank) if role == "owner" else (None, None)
    collectives.barrier(world)  # owners' servers are healthy (may take minutes on a GPU)
    if role == "client":
        engine, transport = build_sglang(cfg, model_dir, placement, parallel.rank)
    log.info("placement %s", json.dumps({"rank": parallel.rank, "host": host, "pid": os.getpid(),
                                         "local_rank": placement.local_rank(parallel.rank), "role": role,
                                         "owned_servers": placement.owned_servers(parallel.rank),
                                         "servers": placement.servers_for(parallel.rank)
                                         if role and placement.layout != "embedded" else []}))
    return engine, transport, placement


def wire_ipc_gather(cfg: RunConfig, placement, parallel, host_groups, transport):
    """Colocated tensor transport: every rank of a host sends its own GPU's copy of each bucket to
    the owner (a gloo group of the host's ranks in GPU order), so each server gets IPC handles on
    its own GPUs. Collective over the world. Returns this rank's WeightSync peer (None on the owner,
    which gets the gather, and where nothing is wired: PP > 1 stages hold only their own layers)."""
    from megatron_rl.sync.sglang_transport import GlooGather, ipc_peer

    if not (placement is not None and placement.layout == "colocated" and cfg.rollout.engine == "sglang"
            and cfg.rollout.sglang.weight_transport == "tensor" and parallel.pp_size == 1
            and host_groups.world is not None):
        return None
    host = placement.host_of(parallel.rank)
    group = collectives.gloo_subgroup(list(host.trainer_ranks), host_groups.world,
                                      timedelta(seconds=host_wait_timeout_s(cfg)))
    owner = next(r for r in host.trainer_ranks if placement.is_owner(r))
    if parallel.rank == owner:
        transport.gather = GlooGather(group, owner)
        return None
    return ipc_peer(group, owner)


def fp8_kv_cache(cfg: RunConfig) -> bool:
    """The engine's KV cache is FP8: SGLang's, or the embedded engine's emulation of it."""
    if cfg.rollout.engine == "sglang":
        return cfg.rollout.sglang.kv_cache_dtype.startswith("fp8")
    return cfg.rollout.kv_cache_dtype == "fp8_e4m3"


def kv_calibration_for(cfg: RunConfig, num_layers: int, parallel):
    """actor.kv_amax.KvCalibration when rollout.sglang.kv_scales=calibrated with an FP8 KV cache."""
    if not fp8_kv_cache(cfg) or cfg.rollout.sglang.kv_scales != "calibrated":
        return None
    from megatron_rl.actor.kv_amax import KvCalibration

    return KvCalibration(num_layers, parallel)


def kv_scales_source(cfg: RunConfig, num_layers: int, calibration=None):
    """What WeightSync sends for an FP8 KV cache with every update (a colocated release discards the
    scales SGLang held): the calibrated scales, or unit ones; None without an FP8 KV cache or with
    kv_scales=sent (the scales come from elsewhere and the engine checks they came)."""
    if not fp8_kv_cache(cfg) or cfg.rollout.sglang.kv_scales == "sent":
        return None
    from megatron_rl.rollout.sglang_payload import kv_scale_tensors

    device = "cuda" if torch.cuda.is_available() else "cpu"  # flattened with the weights, on their device
    if calibration is not None:
        return lambda: kv_scale_tensors(calibration.scales(), device)
    return lambda: kv_scale_tensors([(1.0, 1.0)] * num_layers, device)


def host_wait_timeout_s(cfg: RunConfig) -> float:
    """Timeout of the gloo groups that carry long waits: parallel.host_wait_timeout_s, or (0) the
    longest wait the job can have: a server (re)start plus every attempt of a /generate request at
    its full timeout, plus 10 minutes; 2 hours with the embedded engine."""
    if cfg.parallel.host_wait_timeout_s:
        return cfg.parallel.host_wait_timeout_s
    if cfg.rollout.engine != "sglang":
        return 7200.0
    sg = cfg.rollout.sglang
    return sg.startup_timeout_s + (sg.max_retries + 1) * sg.request_timeout_s + 600.0


def build_controller(cfg: RunConfig):
    from megatron_rl.algo.calibrated_clip import controller_from_config
    return controller_from_config(cfg.calib, cfg.algo)


def build_actor_settings(cfg: RunConfig):
    """resolve_settings for this machine, then the device gates (TE's environment right and TE
    present on CUDA, the FP8 recipe supported by the GPU). Runs before Megatron is imported, so
    the NVTE_* check precedes any TE import."""
    from megatron_rl.actor.settings import check_device, resolve_settings

    from megatron_rl.fp8.te_recipe import wgrad_fusion_available

    cuda = torch.cuda.is_available()
    settings = resolve_settings(cfg, cuda=cuda, wgrad_fusion=cuda and wgrad_fusion_available())
    if settings.transformer_impl == "transformer_engine":
        from megatron_rl.fp8.te_recipe import require_te
        require_te(build_fp8_recipe(cfg))
    check_device(settings, cfg.precision.train_recipe,
                 torch.cuda.get_device_capability() if cuda else None)
    return settings


def log_actor_settings(cfg: RunConfig, settings, parallel) -> None:
    """The one start line (what runs where) and its record in the run folder, which labels
    every result with the dtype and FP8 path it really used."""
    line = settings.summary(cfg.precision.train_recipe, parallel.dp_size)
    if parallel.rank == 0:
        log.info("%s", line)
        info = {"settings": settings.to_dict(), "train_recipe": cfg.precision.train_recipe,
                "dp_size": parallel.dp_size, "summary": line}
        Path(cfg.log.dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.log.dir) / "actor_settings.json").write_text(json.dumps(info, indent=1))


def build_actor(cfg: RunConfig, settings, parallel, model_dir: Path):
    """The actor from its HF folder (or the model.megatron_ckpt weights), after the start line."""
    from megatron_rl.actor.actor import MegatronActor

    log_actor_settings(cfg, settings, parallel)
    from megatron_rl.actor.schedule import LRSchedule

    t = cfg.train
    schedule = LRSchedule(warmup_steps=t.lr_warmup_steps, decay_style=t.lr_decay_style,
                          decay_steps=t.lr_decay_steps or t.num_steps, min_lr=t.min_lr)
    actor = MegatronActor.build(model_dir, parallel=parallel, fp8_recipe=build_fp8_recipe(cfg), lr=t.lr,
                                weight_decay=t.weight_decay, adam_betas=(t.adam_beta1, t.adam_beta2),
                                adam_eps=t.adam_eps, lr_schedule=schedule, clip_grad=t.clip_grad, seed=t.seed,
                                load_weights=not cfg.model.megatron_ckpt, settings=settings)
    if cfg.model.megatron_ckpt:
        actor.load_checkpoint(cfg.model.megatron_ckpt, model_only=True)
    return actor


def build_reference(cfg: RunConfig, settings, parallel, model_dir: Path):
    """The frozen reference policy, or None when no KL term needs it: the run's initial weights
    (model_dir's safetensors or model.megatron_ckpt, the planted outliers included), sharded like
    the actor (same TP / PP). Never from a resumed checkpoint: a resume rebuilds the same one."""
    from megatron_rl.actor.actor import MegatronActor

    a, m = cfg.algo, cfg.model
    if not a.needs_reference:
        return None
    recipe = build_fp8_recipe(cfg) if a.ref_precision == "train" else None  # bf16: no FP8 layers at all
    ref = MegatronActor.build(model_dir, parallel=parallel, fp8_recipe=recipe, seed=cfg.train.seed,
                              load_weights=not m.megatron_ckpt, settings=settings, frozen=True)
    if m.megatron_ckpt:
        ref.load_checkpoint(m.megatron_ckpt, model_only=True)
    if m.outlier_channels:  # the actor's are planted on a fresh start; same seed, same channels
        ref.plant_outliers(m.outlier_channels, m.outlier_scale, seed=cfg.train.seed)
    return ref


def park_reference(cfg: RunConfig, ref) -> None:
    """Colocated SGLang: the reference's parameters to host memory before the servers start. SGLang
    sizes its KV cache from the device memory free at its start (mem_fraction_static), and the
    memory planner's resident count leaves the reference out: loop/colocated.py keeps it on the host
    outside its own forward (reference_on_device), which is the only use of it with the protocol on."""
    sg = cfg.rollout.sglang
    if ref is not None and cfg.train.colocated_protocol and cfg.rollout.engine == "sglang" and sg.mode == "colocated":
        ref.offload(("params",))


def check_colocated_ipc(cfg: RunConfig, cuda: bool) -> None:
    """Colocated SGLang with the tensor transport on GPUs needs, for every server, IPC handles of a
    copy on that server's own GPUs (sync.sglang_transport.SGLangTensorTransport); with PP > 1 only
    pipeline stage 0's TP rank 0 holds a whole bucket (sync.weight_sync._pp_relay), so the other
    servers would get handles of another GPU's memory. Refused before anything is built."""
    sg = cfg.rollout.sglang
    if (cuda and cfg.rollout.engine == "sglang" and sg.mode == "colocated" and sg.weight_transport == "tensor"
            and cfg.parallel.pipeline_model_parallel_size > 1):
        raise ValueError("config key 'parallel.pipeline_model_parallel_size': "
                         f"{cfg.parallel.pipeline_model_parallel_size} with colocated SGLang and "
                         "rollout.sglang.weight_transport=tensor would hand servers CUDA IPC handles of "
                         "another GPU's memory; use rollout.sglang.weight_transport=disk, or PP 1")


def build_run(cfg: RunConfig) -> Run:
    from megatron_rl.actor.parallel import init_parallel
    from megatron_rl.actor.quiet import megatron_quiet
    from megatron_rl.loop.checkpoint import Checkpointer
    from megatron_rl.rollout.sglang_checkpoint import rollout_quant_spec
    from megatron_rl.sync.weight_sync import WeightSync
    from megatron_rl.telemetry.logger import MetricsLogger
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.train.seed)
    check_colocated_ipc(cfg, torch.cuda.is_available())
    settings = build_actor_settings(cfg)
    with megatron_quiet():
        parallel = init_parallel(cfg.parallel.tensor_model_parallel_size,
                                 cfg.parallel.pipeline_model_parallel_size, seed=cfg.train.seed)
    model_dir = build_model_dir(cfg, parallel)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loader = build_data(cfg, tokenizer, parallel)
    t = cfg.train
    with megatron_quiet():
        actor = build_actor(cfg, settings, parallel, model_dir)
        ref = build_reference(cfg, settings, parallel, model_dir)
    # Every rank, in the same order, before the owners go off to start servers (minutes).
    host_groups = collectives.make_host_groups(collectives.group_ranks(parallel.mp_group), parallel.dp_group_ranks,
                                               timeout_s=host_wait_timeout_s(cfg))
    park_reference(cfg, ref)
    engine, transport, placement = build_rollout(cfg, model_dir, parallel, host_groups)
    kv_calibration = kv_calibration_for(cfg, actor.spec.num_layers, parallel)
    clients = placement is not None and any(placement.rollout_role(r) == "client"
                                            for r in range(parallel.world_size))
    sync = WeightSync(actor, transport, rollout_quant_spec(cfg),
                      bucket_mb=cfg.sync.bucket_size_mb, check=cfg.sync.check, wait_for_owners=clients,
                      wait_group=host_groups.world,
                      peer=wire_ipc_gather(cfg, placement, parallel, host_groups, transport),
                      kv_scales=kv_scales_source(cfg, actor.spec.num_layers, kv_calibration),
                      follower=engine if transport is None and engine is not None else None)
    checkpointer = Checkpointer(Path(cfg.log.dir) / "checkpoints", hf_dir=model_dir,
                                async_save=cfg.checkpoint.async_save, keep_last=cfg.checkpoint.keep_last)
    start = checkpointer.latest_step() if cfg.checkpoint.resume is True else 0
    w = cfg.log.wandb
    logger = MetricsLogger(cfg.log.dir, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress,
                           total_steps=t.num_steps, start_step=start, enabled=parallel.rank == 0,
                           wandb={"project": w.project, "name": w.name, "mode": w.mode, "config": cfg.to_dict()})
    if parallel.rank == 0:
        save_config(cfg, Path(cfg.log.dir) / "config.yaml")
    return Run(cfg, parallel, tokenizer, loader, actor, engine, sync, build_rewards(cfg),
               build_controller(cfg), logger, checkpointer, host_groups=host_groups, ref=ref,
               kv_calibration=kv_calibration)
