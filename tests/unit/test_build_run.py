"""What build_run assembles from a config, checked on the built objects of a tiny run (one process,
the embedded engine, no warm start): the engine and its knobs, the actor's optimizer and schedule,
the reference, the loader, the reward runner, the checkpointer and logger, the files a run leaves
in its folder, and Run's own bookkeeping (save / export steps, finish's order)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import megatron.core.tensor_parallel  # noqa: F401 - imported at collection, not inside each test
import pytest
import torch
import transformers  # noqa: F401

from megatron_rl.config import load_config
from megatron_rl.loop import build

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_rl_loop import EXAMPLES, TINY  # noqa: E402

BASE = [*TINY, "train.sft_steps=0", "train.colocated_protocol=false", "model.tiny_num_layers=1"]


@pytest.fixture
def make_run(tmp_path, parallel_restored):
    """make_run(*overrides) -> build_run of the tiny fp8_calibrated config (finished afterwards)."""
    runs = []

    def make(*overrides: str):
        cfg = load_config(EXAMPLES / "fp8_calibrated.yaml", [*BASE, f"log.dir={tmp_path / f'run{len(runs)}'}",
                                                              *overrides])
        runs.append(build.build_run(cfg))
        return runs[-1]

    yield make
    for run in runs:
        run.finish()


def test_the_embedded_engine_gets_the_rollout_precision_of_the_config(make_run):
    run = make_run("precision.rollout_quant=fp8_blockwise", "precision.weight_block_size=[32,32]",
                   "precision.high_precision=[lm_head,norm]",
                   "precision.scale_format=ue8m0", "rollout.kv_cache_dtype=fp8_e4m3", "train.seed=11")
    from megatron_rl.rollout.torch_engine import TorchRolloutEngine
    from megatron_rl.sync.transport import InProcessTransport

    e = run.engine
    assert type(e) is TorchRolloutEngine and type(run.sync.transport) is InProcessTransport
    assert run.sync.transport.engine is e
    assert (e.rollout_quant, e.weight_block_size, e.scale_format) == ("fp8_blockwise", (32, 32), "ue8m0")
    assert e.high_precision == ("lm_head", "norm")
    assert e.kv_scales == [[1.0, 1.0]]  # the FP8 KV cache's unit scales, one layer
    assert e._generator.initial_seed() == 11
    assert run.is_engine_rank and run.is_log_rank and run.host_groups is not None
    # the model folder: the tiny warm-start cache next to the run folder, the tokenizer read from it
    assert Path(e.stop_tokenizer_source).parent == Path(run.cfg.log.dir).parent / ".tiny_models"
    assert run.tokenizer.eos_token_id is not None


def test_the_actor_follows_the_optimizer_and_schedule_of_the_config(make_run):
    run = make_run("train.lr=1e-3", "train.min_lr=1e-4", "train.lr_warmup_steps=2", "train.lr_decay_style=linear",
                   "train.num_steps=6", "train.weight_decay=0.01", "train.adam_beta1=0.8", "train.adam_beta2=0.9",
                   "train.adam_eps=1e-6", "train.clip_grad=0.5")
    a = run.actor
    assert a.clip_grad == 0.5
    groups = a.optimizer.param_groups
    assert {(g["betas"], g["eps"]) for g in groups} == {((0.8, 0.9), 1e-6)}
    assert {g["weight_decay"] for g in groups} <= {0.01, 0.0} and 0.01 in {g["weight_decay"] for g in groups}
    # warm-up from 0 over 2 steps, then linear decay to min_lr at train.num_steps (decay_steps 0)
    expected = [0.0, 5e-4, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4]
    seen = [a.lr]
    for _ in range(7):
        a.advance_lr_schedule()
        seen.append(a.lr)
    assert seen == pytest.approx(expected, abs=1e-12)
    assert run.ref is None and run.kv_calibration is None


def test_the_start_line_is_logged_and_kept_in_the_run_folder(make_run, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.build"):
        run = make_run("precision.train_recipe=tensorwise")
    info = json.loads((Path(run.cfg.log.dir) / "actor_settings.json").read_text())
    assert info["train_recipe"] == "tensorwise" and info["dp_size"] == 1
    assert info["settings"] == run.actor.settings.to_dict()
    assert info["summary"] == run.actor.settings.summary("tensorwise", 1)
    assert info["summary"] in caplog.text
    placement = [r.getMessage() for r in caplog.records if r.getMessage().startswith("placement ")]
    assert len(placement) == 1
    assert json.loads(placement[0].removeprefix("placement ")) == {
        "rank": 0, "host": run.cfg.rollout.sglang.host, "pid": os.getpid(), "local_rank": 0,
        "role": "owner", "owned_servers": [], "servers": []}


def test_the_config_the_run_used_is_saved_and_reads_back(make_run):
    run = make_run("train.lr=3e-4", "rollout.max_new_tokens=7")
    saved = load_config(Path(run.cfg.log.dir) / "config.yaml", [])
    assert saved.to_dict() == run.cfg.to_dict()
    assert (saved.train.lr, saved.rollout.max_new_tokens) == (3e-4, 7)


def test_the_checkpointer_and_logger_follow_the_config(make_run):
    run = make_run("checkpoint.async_save=true", "checkpoint.keep_last=3", "train.num_steps=9")
    c = run.checkpointer
    assert c.root == Path(run.cfg.log.dir) / "checkpoints" and c.async_save and c.keep_last == 3
    assert c.hf_dir == Path(run.engine.stop_tokenizer_source)
    lg = run.logger
    assert lg.enabled and lg.total_steps == 9 and lg.dir == Path(run.cfg.log.dir)


@pytest.mark.parametrize("ref_precision, fp8", [("train", True), ("bf16", False)])
def test_the_reference_is_a_frozen_copy_of_the_initial_weights(make_run, ref_precision, fp8):
    run = make_run("algo.kl_loss_coef=0.1", f"algo.ref_precision={ref_precision}")
    ref, actor = run.ref, run.actor
    assert ref is not None and ref.optimizer is None
    assert all(not p.requires_grad for p in ref.model[0].parameters())
    assert (ref.fp8_recipe is not None) is fp8
    for (name, p), (_, q) in zip(actor.model[0].named_parameters(), ref.model[0].named_parameters()):
        assert torch.equal(p.detach().float(), q.detach().float()), name


def test_planted_outliers_reach_the_actor_and_the_reference_alike(make_run, caplog):
    run = make_run("model.outlier_channels=2", "model.outlier_scale=8", "algo.kl_loss_coef=0.1")
    before = [p.detach().clone() for p in run.actor.model[0].parameters()]
    channels, real = [], run.actor.plant_outliers
    run.actor.plant_outliers = lambda *a, **k: channels.extend(real(*a, **k)) or channels
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.build"):
        run.plant_outliers()
    assert len(channels) == 2
    assert f"planted activation outliers x8 in hidden channels {channels}" in caplog.messages
    after = list(run.actor.model[0].parameters())
    assert any(not torch.equal(b, a.detach()) for b, a in zip(before, after))
    for p, q in zip(run.actor.model[0].parameters(), run.ref.model[0].parameters()):
        assert torch.equal(p.detach().float(), q.detach().float())  # the reference is built planted


def test_no_outliers_leave_the_weights_alone(make_run):
    run = make_run()
    before = [p.detach().clone() for p in run.actor.model[0].parameters()]
    run.plant_outliers()
    assert all(torch.equal(b, a.detach()) for b, a in zip(before, run.actor.model[0].parameters()))


def test_an_fp8_kv_cache_with_calibrated_scales_gets_a_calibration_and_its_scales_are_sent(make_run):
    run = make_run("rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.kv_scales=calibrated")
    from megatron_rl.actor.kv_amax import KvCalibration

    assert isinstance(run.kv_calibration, KvCalibration)
    assert run.sync.kv_scales is not None


# --- the pieces build_run calls, on configs alone ----------------------------------------------------


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


@pytest.mark.parametrize("overrides, fp8", [
    ((), False), (("rollout.kv_cache_dtype=fp8_e4m3",), True),
    (("rollout.engine=sglang",), False), (("rollout.engine=sglang", "rollout.sglang.kv_cache_dtype=fp8_e4m3"), True),
    (("rollout.engine=sglang", "rollout.kv_cache_dtype=fp8_e4m3"), False),  # the embedded engine's knob
])
def test_which_kv_cache_is_fp8(overrides, fp8):
    assert build.fp8_kv_cache(_cfg(*overrides)) is fp8


def test_kv_scales_sent_with_each_update():
    unit = build.kv_scales_source(_cfg("rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.kv_scales=unit"), 3)
    tensors = dict(unit())
    assert len(tensors) == 6 and all(float(t) == 1.0 for t in tensors.values())  # k and v scale per layer
    calibrated = SimpleNamespace(scales=lambda: [(2.0, 0.5)] * 3)
    sent = dict(build.kv_scales_source(_cfg("rollout.kv_cache_dtype=fp8_e4m3"), 3, calibrated)())
    assert sorted(float(t) for t in sent.values()) == [0.5] * 3 + [2.0] * 3
    assert build.kv_scales_source(_cfg("rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.kv_scales=sent"), 3) is None
    assert build.kv_scales_source(_cfg(), 3) is None
    assert build.kv_calibration_for(_cfg("rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.kv_scales=unit"), 3, None) is None
    assert build.kv_calibration_for(_cfg("rollout.sglang.kv_scales=calibrated"), 3, None) is None


def test_host_wait_timeout_covers_the_longest_wait():
    assert build.host_wait_timeout_s(_cfg("parallel.host_wait_timeout_s=42")) == 42
    assert build.host_wait_timeout_s(_cfg()) == 7200.0
    sg = _cfg("rollout.engine=sglang", "rollout.sglang.startup_timeout_s=100", "rollout.sglang.max_retries=2",
              "rollout.sglang.request_timeout_s=30")
    assert build.host_wait_timeout_s(sg) == 100 + 3 * 30 + 600


def test_the_reward_function_of_a_run():
    assert build.reward_name(_cfg("reward.name=exact_match")) == "exact_match"
    from megatron_rl.data.tasks import get_task

    assert build.reward_name(_cfg("data.task=sort")) == get_task("sort").reward_fn
    assert build.reward_name(_cfg("data.task=chain")) == get_task("chain").reward_fn == "final_answer"
    assert build.reward_name(_cfg("data.path=x.jsonl")) == "math_verify"


def test_the_reward_runner_a_config_asks_for():
    from megatron_rl.rewards import HttpReward

    r = build.build_rewards(_cfg("reward.url=http://127.0.0.1:9/score", "reward.timeout_s=2", "reward.max_retries=1",
                                 "reward.retry_backoff_s=0.5"))
    try:
        assert isinstance(r.fn, HttpReward) and r.batched
        assert (r.fn.url, r.fn.timeout_s, r.fn.max_retries, r.fn.backoff_s) == ("http://127.0.0.1:9/score", 2, 1, 0.5)
        assert r.timeout_s == (2 * 2 + 0.5) + 5.0  # every attempt and backoff, then 5 s
    finally:
        r.close()
    r = build.build_rewards(_cfg("reward.name=exact_match", "reward.timeout_s=3"))
    try:
        assert (r.name, r.timeout_s, r.batched) == ("exact_match", 3, False)
    finally:
        r.close()
    with pytest.raises(ValueError, match="reward 'exact_match': built-in rewards are per-sample; batched needs"):
        build.build_rewards(_cfg("reward.name=exact_match", "reward.batched=true"))


class _Parallel(SimpleNamespace):
    rank = 0


def test_the_weight_sync_follows_the_config_and_waits_for_no_owner_without_clients(make_run):
    run = make_run("sync.bucket_size_mb=3", "sync.check=true")
    assert run.sync.bucket_bytes == 3 * 2**20 and run.sync.check
    assert run.sync.wait_for_owners is False  # the embedded engine: one owner, no client rank to wait for


@pytest.mark.parametrize("resume", [True, False])
def test_a_resumed_run_keeps_the_metrics_of_the_steps_before_its_checkpoint(make_run, tmp_path, resume):
    log_dir = tmp_path / "resumed"
    (log_dir / "checkpoints").mkdir(parents=True)
    (log_dir / "checkpoints" / "latest").write_text("3")
    (log_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": i}) + "\n" for i in range(5)))
    run = make_run(f"log.dir={log_dir}", f"checkpoint.resume={str(resume).lower()}")
    assert [h["step"] for h in run.logger.history] == ([0, 1, 2] if resume else [])


def test_the_prompt_format_of_the_data_section_reaches_the_dataset():
    cfg = _cfg("data.chat_template=true", "data.system_prompt=Be brief.", "data.prompt_template=Solve {prompt} now")
    cfg.data.template_kwargs = {"enable_thinking": False}
    kw = build._dataset_kwargs(cfg.data)
    fmt = kw.pop("fmt")
    assert (fmt.apply_chat_template, fmt.system_prompt, fmt.prompt_template) == (True, "Be brief.", "Solve {prompt} now")
    assert fmt.template_kwargs == {"enable_thinking": False} and fmt.template_kwargs is not cfg.data.template_kwargs
    d = cfg.data
    assert kw == dict(prompt_key=d.prompt_key, answer_key=d.answer_key, max_prompt_len=d.max_prompt_len)


def test_epochs_cap_the_steps_of_a_run(make_run):
    run = make_run("data.num_examples=12", "data.prompts_per_step=4", "data.num_epochs=2", "train.num_steps=50")
    assert run.cfg.train.num_steps == 6 and run.loader.batch_size == 4


def _data_cfg(tmp_path, *overrides: str):
    """(config, the tiny model's tokenizer) for build_data / build_dataset calls."""
    from transformers import AutoTokenizer

    from megatron_rl.loop.warmstart import prepare_tiny_model

    cfg = load_config(EXAMPLES / "fp8_calibrated.yaml", [*BASE, f"log.dir={tmp_path}", *overrides])
    return cfg, AutoTokenizer.from_pretrained(prepare_tiny_model(cfg, tmp_path / "models"))


def test_a_loader_that_cannot_fill_its_batches_is_refused(tmp_path):
    cfg, tok = _data_cfg(tmp_path, "data.num_examples=3", "data.prompts_per_step=4", "data.num_epochs=1")
    with pytest.raises(ValueError, match=r"config key 'data.prompts_per_step': 4 is not divisible by the "
                                         r"data-parallel size 3"):
        build.build_data(cfg, tok, _Parallel(dp_size=3))
    with pytest.raises(ValueError, match=r"config key 'data.num_epochs': 1 epochs of 3 prompts hold no full batch "
                                         r"of data.prompts_per_step=4"):
        build.build_data(cfg, tok, _Parallel(dp_size=1))
    with pytest.raises(ValueError, match=r"config key 'data.path': no such file .*nowhere.jsonl"):
        build.build_dataset(load_config(None, [f"data.path={tmp_path / 'nowhere.jsonl'}"]).data, tok, 0)


def test_a_users_jsonl_file_is_read_with_its_own_keys(tmp_path):
    _, tok = _data_cfg(tmp_path)
    rows = [{"q": f"sort {i} {i + 2} {i + 1}", "a": f"{i} {i + 1} {i + 2}"} for i in range(5)]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mine = build.build_dataset(load_config(None, [f"data.path={tmp_path / 'mine.jsonl'}", "data.prompt_key=q",
                                                  "data.answer_key=a"]).data, tok, 0)
    assert [p.answer for p in mine] == [r["a"] for r in rows]


def test_epochs_that_hold_exactly_the_steps_cap_nothing(tmp_path, caplog):
    def steps_after_build(num_steps: int) -> tuple[int, bool]:
        cfg, tok = _data_cfg(tmp_path, "data.num_examples=12", "data.prompts_per_step=4", "data.num_epochs=1",
                             f"train.num_steps={num_steps}")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_rl.loop.build"):
            build.build_data(cfg, tok, _Parallel(dp_size=1))
        return cfg.train.num_steps, any("capped" in m for m in caplog.messages)

    assert steps_after_build(3) == (3, False)  # 12 prompts, 4 a step: 3 steps, nothing capped
    assert steps_after_build(4) == (3, True)


def _run_for_steps(*overrides: str):
    """A Run whose checkpointer records what it is asked (it must be handed the run itself)."""
    run = build.Run(_cfg(*overrides), SimpleNamespace(rank=0), None, None, None, None, None, None, None, None, None)
    run.checkpointer = SimpleNamespace(save=lambda r, step: saved.append(step) if r is run else saved.append(None),
                                       load_latest=lambda r: 7 if r is run else None)
    return run


saved: list[int] = []


@pytest.mark.parametrize("every, final, steps, due", [
    (0, False, 5, []), (2, False, 5, [1, 3]), (2, True, 5, [1, 3, 4]), (0, True, 3, [2]), (3, True, 6, [2, 5]),
])
def test_checkpoints_are_due_every_save_every_steps_and_at_the_end(every, final, steps, due):
    run = _run_for_steps(f"checkpoint.save_every={every}", f"checkpoint.save_final={str(final).lower()}",
                         f"train.num_steps={steps}")
    assert [s for s in range(steps) if run.save_due(s)] == due
    saved.clear()
    for s in range(steps):
        run.maybe_save(s)
    assert saved == [s + 1 for s in due]  # a checkpoint is named by the updates it holds


def test_hf_exports_are_due_every_save_hf_every_steps_and_a_resume_asks_the_checkpointer():
    run = _run_for_steps("checkpoint.save_hf_every=3", "train.num_steps=10")
    assert [s for s in range(10) if run.hf_export_due(s)] == [2, 5, 8]
    assert not any(_run_for_steps().hf_export_due(s) for s in range(10))
    assert _run_for_steps("checkpoint.resume=true").resume_step() == 7
    assert _run_for_steps("checkpoint.resume=false").resume_step() == 0


def test_an_hf_export_holds_the_weights_after_its_step(make_run):
    run = make_run()
    run.export_hf(4)
    out = Path(run.cfg.log.dir) / "hf" / "step_000005"
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))


def test_finish_publishes_the_checkpoint_then_closes_the_transport_before_the_servers(tmp_path, caplog):
    calls = []

    def rec(name):
        return lambda *a, **k: calls.append(name)

    from megatron_rl.telemetry.logger import MetricsLogger

    cfg = _cfg(f"log.dir={tmp_path}", "log.plot=true", "log.tensorboard=false", "log.progress=false")
    logger = MetricsLogger(tmp_path, tensorboard=False, progress=False)
    logger.log(0, {"reward/mean": 0.5, "entropy": 1.0})
    run = build.Run(cfg, SimpleNamespace(rank=0, tp_rank=0, pp_rank=0), None, None,
                    SimpleNamespace(settings=SimpleNamespace(params_dtype="float32")),
                    SimpleNamespace(shutdown=rec("engine.shutdown")), SimpleNamespace(close=rec("sync.close")),
                    SimpleNamespace(close=rec("rewards.close")), None, logger,
                    SimpleNamespace(wait=rec("checkpointer.wait")))
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.build"):
        run.finish()
    assert calls == ["checkpointer.wait", "sync.close", "engine.shutdown", "rewards.close"]
    assert (tmp_path / "curves.png").is_file()
    assert f"summary\n{logger.summary()}" in caplog.messages and logger.summary()
    assert f"curves written to {tmp_path / 'curves.png'}" in caplog.messages
    calls.clear()
    run.engine = None  # a rank without an engine
    run.finish()
    assert calls == ["checkpointer.wait", "sync.close", "rewards.close"]


# --- SGLang: the servers a rank launches or attaches to, and the transport it feeds them with ---------


def _sglang_cfg(tmp_path, *overrides: str):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from doubles.sglang_testing import API_KEY, SERVER_COMMAND, free_port_block

    os.environ["MEGATRON_RL_SGLANG_API_KEY"] = API_KEY
    command = "[" + ",".join(f"'{c}'" for c in SERVER_COMMAND) + "]"
    return load_config(None, ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated",
                              f"rollout.sglang.server_command={command}", f"rollout.sglang.base_port={free_port_block(1)}",
                              "rollout.sglang.startup_timeout_s=120", f"log.dir={tmp_path / 'run'}", *overrides])


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_a_disaggregated_owner_launches_its_servers_and_feeds_them_by_the_configured_transport(
        qwen2_dir, tmp_path, monkeypatch, transport):
    from megatron_rl.sync.disk_transport import DiskTransport
    from megatron_rl.sync.sglang_transport import SGLangNcclTransport

    monkeypatch.delenv("MEGATRON_RL_LOG_DIR", raising=False)
    cfg = _sglang_cfg(tmp_path, f"rollout.sglang.weight_transport={transport}", "sync.check=true",
                      f"rollout.sglang.disk_dir={tmp_path / 'shared'}", "rollout.sglang.nccl_master_addr=10.0.0.7",
                      "rollout.sglang.nccl_master_port=29777", "train.seed=13")
    engine, sender = build.build_engine(cfg, qwen2_dir)  # rollout.engine=sglang
    try:
        assert sender.engine is engine and len(engine.servers) == 1
        argv = engine.servers[0].process.argv
        assert argv[argv.index("--random-seed") + 1] == "13"  # the servers sample with the run's seed
        assert engine.cfg.server_urls == [] and engine.cfg.base_port == cfg.rollout.sglang.base_port
        if transport == "nccl":
            assert type(sender) is SGLangNcclTransport and sender.checked.check
            assert (sender.master_addr, sender.master_port, sender.backend) == ("10.0.0.7", 29777, "gloo")
        else:
            assert type(sender) is DiskTransport and sender.root == tmp_path / "shared"
            assert sender.template_dir == Path(qwen2_dir)
        logs = tmp_path / "run" / "sglang" / cfg.rollout.sglang.host  # one folder per host
        assert logs.is_dir() and list(logs.iterdir())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("transport", ["disk", "tensor"])
def test_a_colocated_client_attaches_to_its_hosts_servers_and_sends_nothing(qwen2_dir, tmp_path, monkeypatch,
                                                                            transport):
    from megatron_rl.cluster.placement import placement_for_config
    from megatron_rl.sync.disk_transport import DiskTransport
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    owner_cfg = _sglang_cfg(tmp_path, "rollout.sglang.mode=colocated", f"rollout.sglang.weight_transport={transport}",
                            f"rollout.sglang.disk_dir={tmp_path / 'shared'}", "sync.check=true")
    monkeypatch.setenv("MEGATRON_RL_LOG_DIR", str(tmp_path / "logs"))
    # the plan names the host "localhost", the section 127.0.0.1: each rank's logs go under the plan's name
    placement = placement_for_config(owner_cfg, ["localhost"], 2)  # 2 ranks, one server each
    owner = client = None
    try:
        owner, sender = build.build_sglang(owner_cfg, qwen2_dir, placement, 0)
        assert type(sender) is {"disk": DiskTransport, "tensor": SGLangTensorTransport}[transport]
        assert sender.engine is owner and len(owner.servers) == 2
        if transport == "tensor":
            assert sender.checked.check and sender.gather is None  # one sender; wire_ipc_gather adds the rest
        assert (tmp_path / "logs" / "localhost").is_dir()
        client, nothing = build.build_engine(owner_cfg, qwen2_dir, placement, 1)
        assert nothing is None
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["localhost"]
        assert [s.url for s in client.servers] == placement.servers_for(1)
    finally:
        for e in (client, owner):
            if e is not None:
                e.shutdown()


@pytest.mark.parametrize("plot, history, calib, title", [
    (True, True, True, "blockwise params=float32 calib=on"), (True, True, False, "blockwise params=float32 calib=off"),
    (False, True, True, None), (True, False, True, None)])
def test_curves_are_drawn_when_asked_and_there_is_something_to_draw(tmp_path, monkeypatch, plot, history, calib, title):
    from megatron_rl.telemetry import plotting
    from megatron_rl.telemetry.logger import MetricsLogger

    drawn = []
    monkeypatch.setattr(plotting, "plot_runs", lambda runs, path, title: drawn.append((list(runs), path, title)) or path)
    cfg = _cfg(f"log.dir={tmp_path / 'myrun'}", f"log.plot={str(plot).lower()}", "precision.train_recipe=blockwise",
               f"calib.enabled={str(calib).lower()}")
    logger = MetricsLogger(tmp_path / "myrun", tensorboard=False, progress=False)
    if history:
        logger.log(0, {"reward/mean": 0.5})
    nothing = SimpleNamespace(close=lambda: None, wait=lambda: None, shutdown=lambda: None)
    build.Run(cfg, SimpleNamespace(rank=0, tp_rank=0, pp_rank=0), None, None,
              SimpleNamespace(settings=SimpleNamespace(params_dtype="float32")), None, nothing, nothing, None, logger,
              nothing).finish()
    assert drawn == ([] if title is None else [(["myrun"], tmp_path / "myrun" / "curves.png", title)])


def test_the_fp8_recipe_of_the_config():
    recipe = build.build_fp8_recipe(_cfg("precision.train_recipe=delayed", "precision.amax_history_len=7"))
    assert recipe.amax_history_len == 7 and recipe.enabled


def test_a_rank_on_another_node_than_the_plan_says_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_RL_HOSTS", "node-a")
    monkeypatch.setenv("MEGATRON_RL_GPUS_PER_NODE", "1")
    monkeypatch.setenv("SLURMD_NODENAME", "node-b")
    one = SimpleNamespace(world_size=1, rank=0)
    with pytest.raises(ValueError) as err:
        build.build_rollout(_cfg(f"log.dir={tmp_path}"), tmp_path, one)
    assert str(err.value) == ("rank 0 runs on node node-b but the placement plan puts it on node-a "
                              "(torchrun's --node-rank must follow the plan's host order)")


def test_the_embedded_engine_runs_under_the_plan_whatever_the_sglang_mode(make_run, caplog):
    run = make_run("rollout.sglang.mode=disaggregated")  # ignored by the embedded engine
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.build"):
        engine, transport, placement = build.build_rollout(run.cfg, Path(run.engine.stop_tokenizer_source),
                                                           SimpleNamespace(world_size=1, rank=0))
    assert placement is not None and placement.layout == "embedded" and placement.is_owner(0)
    assert transport.engine is engine and engine is not run.engine
    engine.shutdown()


def test_one_process_without_a_plan_owns_the_disaggregated_servers_it_lists(qwen2_dir, tmp_path, monkeypatch):
    for var in ("MEGATRON_RL_HOSTS", "SLURMD_NODENAME", "MEGATRON_RL_LOG_DIR"):
        monkeypatch.delenv(var, raising=False)
    cfg = _sglang_cfg(tmp_path, "rollout.sglang.weight_transport=disk", f"rollout.sglang.disk_dir={tmp_path / 'w'}")
    engine, transport, placement = build.build_rollout(cfg, qwen2_dir, SimpleNamespace(world_size=1, rank=0))
    try:
        assert placement is None and transport.engine is engine and len(engine.servers) == 1
    finally:
        engine.shutdown()


def test_the_start_line_is_recorded_by_rank_0_even_in_a_log_folder_not_made_yet(tmp_path, caplog):
    cfg = _cfg(f"log.dir={tmp_path / 'runs' / 'new'}", "precision.train_recipe=blockwise")
    settings = SimpleNamespace(summary=lambda recipe, dp: f"{recipe} on dp={dp}", to_dict=lambda: {"params_dtype": "x"})
    build.log_actor_settings(cfg, settings, SimpleNamespace(rank=1, dp_size=2))
    assert not (tmp_path / "runs").exists()  # another rank logs and writes nothing
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.build"):
        build.log_actor_settings(cfg, settings, SimpleNamespace(rank=0, dp_size=2))
    assert caplog.messages == ["blockwise on dp=2"]
    assert json.loads((tmp_path / "runs" / "new" / "actor_settings.json").read_text()) == {
        "settings": {"params_dtype": "x"}, "train_recipe": "blockwise", "dp_size": 2, "summary": "blockwise on dp=2"}


# --- the sixth round's gaps: what the built pieces take from the config, read on what they do --------


def test_only_rank_0_writes_the_tiny_model_and_every_rank_reads_it_after_the_barrier(tmp_path, monkeypatch):
    from megatron_rl import collectives
    from megatron_rl.loop import warmstart

    calls = []
    monkeypatch.setattr(warmstart, "prepare_tiny_model", lambda cfg, cache: calls.append("prepare") or cache / "m")
    monkeypatch.setattr(collectives, "barrier", lambda group: calls.append("barrier"))
    cfg = _cfg(f"log.dir={tmp_path / 'run'}")
    for rank, expected in ((0, ["prepare", "barrier", "prepare"]), (1, ["barrier", "prepare"]),
                           (2, ["barrier", "prepare"])):
        calls.clear()
        assert build.build_model_dir(cfg, SimpleNamespace(rank=rank)) == tmp_path / ".tiny_models" / "m"
        assert calls == expected, rank  # two ranks writing one folder at once would race


def test_a_parquet_file_and_in_memory_records_are_read_with_the_sections_keys(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, tok = _data_cfg(tmp_path)
    rows = [{"q": f"sort {i} {i + 2} {i + 1}", "a": f"{i} {i + 1} {i + 2}"} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mine.parquet")
    data = load_config(None, ["data.prompt_key=q", "data.answer_key=a", "data.prompt_template=Please {prompt}"]).data
    from_file = build.read_prompts(data, tok, str(tmp_path / "mine.parquet"))
    in_memory = build.read_prompts(data, tok, records=rows)
    for ds in (from_file, in_memory):
        assert [p.answer for p in ds] == [r["a"] for r in rows]
        assert [p.prompt_text for p in ds] == [f"Please {r['q']}" for r in rows]


def _first_batches(tmp_path, *overrides: str) -> list[list[str]]:
    cfg, tok = _data_cfg(tmp_path, "data.num_examples=12", "data.prompts_per_step=4", *overrides)
    loader = build.build_data(cfg, tok, _Parallel(dp_size=1))
    return [[p.answer for p in loader.next_batch()] for _ in range(3)]


def test_the_loader_draws_the_tasks_prompts_with_the_runs_seed_and_shuffle(tmp_path):
    import random

    from megatron_rl.data.tasks import make_task_dataset

    cfg, _ = _data_cfg(tmp_path)
    for seed in (3, 4):
        answers = [r["answer"] for r in make_task_dataset(cfg.data.task, 12, seed=seed)]
        in_order = [answers[i:i + 4] for i in (0, 4, 8)]
        assert _first_batches(tmp_path, f"train.seed={seed}", "data.shuffle=false") == in_order
        order = list(range(12))  # the loader's documented draw: random.Random("prompt-loader:<seed>:<epoch>")
        random.Random(f"prompt-loader:{seed}:0").shuffle(order)
        shuffled = [[answers[i] for i in order[j:j + 4]] for j in (0, 4, 8)]
        assert shuffled != in_order
        assert _first_batches(tmp_path, f"train.seed={seed}", "data.shuffle=true") == shuffled


def test_a_cap_by_epochs_is_logged_with_the_numbers_that_made_it(tmp_path, caplog):
    cfg, tok = _data_cfg(tmp_path, "data.num_examples=12", "data.prompts_per_step=4", "data.num_epochs=1",
                         "train.num_steps=5")
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.build"):
        build.build_data(cfg, tok, _Parallel(dp_size=1))
    assert caplog.messages == ["data.num_epochs=1: 3 steps (train.num_steps=5 capped)"]


def test_a_users_batched_reward_scores_the_whole_batch_in_one_call(tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def score(responses, answers, **kw):\n"
        "    return [float(len(responses)) + float(r == a) for r, a in zip(responses, answers)]\n")
    r = build.build_rewards(_cfg(f"reward.name={tmp_path / 'my_reward.py'}:score", "reward.batched=true"))
    try:
        assert r.batched
        rewards, _ = r.score(["a", "b", "c"], ["a", "x", "c"])
        assert [float(v) for v in rewards] == [4.0, 3.0, 4.0]  # 3 responses seen at once, +1 when right
    finally:
        r.close()


def test_a_megatron_checkpoint_gives_the_actor_and_the_reference_its_weights_and_a_fresh_optimizer(
        make_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from megatron_rl.convert.hf_to_megatron import convert_hf_to_megatron

    start = Path(make_run().engine.stop_tokenizer_source)  # the tiny HF folder of the run
    halved = tmp_path / "halved"
    shutil.copytree(start, halved)
    for f in halved.glob("*.safetensors"):
        save_file({k: v * 0.5 for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    convert_hf_to_megatron(halved, tmp_path / "mcore", progress=False)
    expected = make_run(f"model.hf_dir={halved}").actor  # the halved weights read from HF, independently
    from megatron_rl.actor.actor import MegatronActor

    read, load_hf = [], MegatronActor.load_hf
    monkeypatch.setattr(MegatronActor, "load_hf", lambda self, d: read.append(d) or load_hf(self, d))
    run = make_run(f"model.hf_dir={start}", f"model.megatron_ckpt={tmp_path / 'mcore'}", "algo.kl_loss_coef=0.1")
    assert read == []  # the checkpoint's weights only: no HF read (16 GB per rank for an 8B model) overwritten
    for model in (run.actor.model[0], run.ref.model[0]):
        for (name, p), (_, q) in zip(model.named_parameters(), expected.model[0].named_parameters()):
            assert torch.equal(p.detach(), q.detach()), name
    assert not run.actor.optimizer.state_dict()["state"]  # model_only: the optimizer starts fresh


def test_the_actor_trains_with_the_runs_fp8_recipe_and_the_reference_with_its_settings(make_run):
    run = make_run("precision.train_recipe=tensorwise", "algo.kl_loss_coef=0.1")
    expected = build.build_fp8_recipe(run.cfg)
    a, ref = run.actor, run.ref
    assert a.fp8_recipe is not None and a.fp8_recipe.enabled
    assert (a.fp8_recipe.name, a.fp8_recipe.fp8_format) == (expected.name, expected.fp8_format)
    assert ref.settings.to_dict() == a.settings.to_dict() == build.build_actor_settings(run.cfg).to_dict()


def test_a_kv_calibration_reduces_over_the_runs_own_groups(make_run, monkeypatch):
    run = make_run("rollout.kv_cache_dtype=fp8_e4m3", "rollout.sglang.kv_scales=calibrated")
    reduced, real = [], build.collectives.all_reduce
    monkeypatch.setattr(build.collectives, "all_reduce",
                        lambda t, group, op: reduced.append(group) or real(t, group, op=op))
    with run.kv_calibration.recording(run.actor.model):
        pass  # no forward: every layer unseen
    assert reduced == [run.parallel.mp_group, run.parallel.dp_group]
    assert run.kv_calibration.scales() == [(1e-6 / 448.0, 1e-6 / 448.0)]  # unseen: a finite, positive scale


def test_a_blockwise_rollout_whose_blocks_do_not_divide_the_model_is_refused_before_any_server_starts(
        qwen2_dir, tmp_path):
    cfg = _sglang_cfg(tmp_path, "rollout.sglang.weight_transport=disk", f"rollout.sglang.disk_dir={tmp_path / 'w'}",
                      "precision.rollout_quant=fp8_blockwise",
                      "precision.weight_block_size=[128,128]")
    with pytest.raises(ValueError, match=r"'precision.weight_block_size': activation groups of 128 do not divide"):
        build.build_sglang(cfg, qwen2_dir)
    assert not (tmp_path / "run" / "sglang").exists()


def test_one_process_under_a_launchers_plan_takes_the_plans_placement(qwen2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_HOSTS", "127.0.0.1,127.0.0.2")  # one trainer node, one rollout node
    monkeypatch.setenv("MEGATRON_RL_GPUS_PER_NODE", "1")
    monkeypatch.setenv("MEGATRON_RL_ROLLOUT_NODES", "1")
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    built = []
    monkeypatch.setattr(build, "build_engine", lambda cfg, d, placement=None, rank=0:
                        built.append((placement, rank)) or ("engine", "transport"))
    cfg = _cfg("rollout.engine=sglang", "rollout.sglang.mode=disaggregated", "rollout.sglang.weight_transport=disk",
               f"rollout.sglang.disk_dir={tmp_path / 'w'}", f"log.dir={tmp_path / 'run'}")
    engine, transport, placement = build.build_rollout(cfg, qwen2_dir, SimpleNamespace(world_size=1, rank=0))
    assert (engine, transport) == ("engine", "transport") and built == [(placement, 0)]
    assert placement.layout == "disaggregated" and [h.host for h in placement.hosts] == ["127.0.0.1", "127.0.0.2"]


def test_a_slurm_job_started_without_the_launchers_plan_is_not_held_to_one(qwen2_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRON_RL_HOSTS", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "node-b")  # srun python -m megatron_rl ... on one node
    engine, _, placement = build.build_rollout(_cfg(f"log.dir={tmp_path}"), qwen2_dir,
                                               SimpleNamespace(world_size=1, rank=0))
    try:
        assert placement.layout == "embedded" and placement.is_owner(0)
    finally:
        engine.shutdown()


def test_a_rank_that_neither_owns_nor_samples_logs_no_servers(qwen2_dir, tmp_path, monkeypatch, caplog):
    for var in ("MEGATRON_RL_HOSTS", "SLURMD_NODENAME"):
        monkeypatch.delenv(var, raising=False)
    cfg = _sglang_cfg(tmp_path, "rollout.sglang.mode=colocated", "parallel.tensor_model_parallel_size=2")
    with caplog.at_level(logging.INFO, logger="megatron_rl.loop.build"):
        engine, transport, placement = build.build_rollout(cfg, qwen2_dir, SimpleNamespace(world_size=2, rank=1))
    assert (engine, transport, placement.rollout_role(1)) == (None, None, None)  # TP rank 1: gets samples by broadcast
    (line,) = [m for m in caplog.messages if m.startswith("placement ")]
    assert json.loads(line.removeprefix("placement ")) == {
        "rank": 1, "host": cfg.rollout.sglang.host, "pid": os.getpid(), "local_rank": 1, "role": None,
        "owned_servers": [], "servers": []}


@pytest.mark.parametrize("tensorboard, progress", [(True, False), (False, True)])
def test_the_metrics_logger_follows_the_log_section(make_run, monkeypatch, tensorboard, progress):
    from megatron_rl.telemetry import logger as logger_module

    started = []  # what W&B is started with (wandb itself: test_telemetry_wandb.py)
    monkeypatch.setattr(logger_module, "_start_wandb", lambda d, opts: started.append((d, opts)))
    run = make_run(f"log.tensorboard={str(tensorboard).lower()}", f"log.progress={str(progress).lower()}",
                   "log.wandb.project=fp8rl", "log.wandb.name=trial", "log.wandb.mode=offline")
    lg = run.logger
    assert (Path(run.cfg.log.dir) / "tb").is_dir() is tensorboard and (lg._tb is not None) is tensorboard
    assert (lg._bar is not None) is progress
    assert started == [(Path(run.cfg.log.dir), {"project": "fp8rl", "name": "trial", "mode": "offline",
                                                "config": run.cfg.to_dict()})]


@pytest.mark.parametrize("kv_scales", ["unit", "calibrated"])
def test_each_update_sends_the_kv_scales_of_the_section(make_run, kv_scales):
    run = make_run("rollout.kv_cache_dtype=fp8_e4m3", f"rollout.sglang.kv_scales={kv_scales}")
    if kv_scales == "calibrated":  # as if the last old-log-prob forward had seen |K| = 896, |V| = 224
        run.kv_calibration.amax = torch.tensor([[896.0, 224.0]], dtype=torch.float64)
    sent = sorted(float(t) for _, t in run.sync.kv_scales())
    assert sent == ([1.0, 1.0] if kv_scales == "unit" else [0.5, 2.0])  # one layer: its k and v scale


def test_a_colocated_owner_launches_its_hosts_servers_whatever_the_section_lists():
    from megatron_rl.cluster.placement import placement_for_config

    cfg = _cfg("rollout.engine=sglang", "rollout.sglang.mode=colocated", "rollout.sglang.weight_transport=disk",
               "rollout.sglang.disk_dir=/shared/w", "rollout.sglang.server_urls=[http://elsewhere:30000]",
               "rollout.sglang.launch_router=true")  # a disaggregated section's leftovers
    placement = placement_for_config(cfg, ["node-a"], 2)
    owner, client = (build.sglang_config_for(cfg, placement, r) for r in (0, 1))
    assert (owner.host, owner.num_servers, owner.server_urls) == ("node-a", 2, [])  # it starts its own two
    assert client.server_urls == placement.servers_for(1) and client.router_url == ""
    assert not owner.launch_router and not client.launch_router  # colocated: no router, whoever asks


COLOCATED = ["rollout.sglang.mode=colocated", "rollout.sglang.weight_transport=tensor"]
DISAGGREGATED = ["rollout.sglang.mode=disaggregated", "rollout.sglang.weight_transport=nccl"]


@pytest.mark.parametrize("overrides, parked", [
    ([*COLOCATED, "train.colocated_protocol=true"], True),
    ([*COLOCATED, "train.colocated_protocol=false"], False),
    ([*DISAGGREGATED, "train.colocated_protocol=true"], False),
])
def test_the_reference_leaves_the_device_before_colocated_servers_start(make_run, monkeypatch, overrides, parked):
    """SGLang sizes its KV cache from the memory free when it starts: the reference (on the device
    only inside its own forward with the colocated protocol) must be off it by then."""
    refs, resident = [], []
    real_reference = build.build_reference

    def reference(*args):
        refs.append(real_reference(*args))
        return refs[-1]

    def rollout(cfg, model_dir, parallel, host_groups=None):  # where the owners start their servers
        resident.append(sum(p.untyped_storage().nbytes() for p in refs[0].model[0].parameters()))
        return None, None, None

    monkeypatch.setattr(build, "build_reference", reference)
    monkeypatch.setattr(build, "build_rollout", rollout)
    make_run("algo.kl_loss_coef=0.1", "rollout.engine=sglang", *overrides)
    params = sum(p.numel() * p.element_size() for p in refs[0].model[0].parameters())
    assert params > 0 and resident == [0 if parked else params]
