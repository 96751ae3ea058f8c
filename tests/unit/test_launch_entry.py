"""`megatron-rl launch` in-process: what each srun task runs (trainer or servers) from Slurm's
variables, the plan a trainer rank recomputes from what its launcher exported, the servers' model
and command lines (the router's included), torchrun as a child that a SIGTERM ends. The
real-Slurm jobs are tests/cluster; the dry run as a command is tests/unit/test_launch.py."""

from __future__ import annotations

import json
import signal
import sys
import threading

import pytest

from megatron_rl.cluster import launch
from megatron_rl.cluster.launch import (_gpus_on_node, main, placement_for_run, plan_env, serve_argvs, serve_model,
                                        this_host, trainer_argv, world_from_env)
from megatron_rl.cluster.placement import placement_for_config
from megatron_rl.config import load_config

pytestmark = pytest.mark.timeout(60)

DISAGG = ["rollout.engine=sglang", "rollout.sglang.mode=disaggregated", "rollout.sglang.weight_transport=nccl",
          "rollout.sglang.tp_size=4", "rollout.sglang.base_port=31000", "rollout.sglang.router_port=31999",
          "rollout.sglang.launch_router=true"]
SERVER = ["/opt/sg/bin/server"]
ROUTER = ["/opt/sg/bin/router", "--flag"]
COMMANDS = [f"rollout.sglang.server_command=[{SERVER[0]}]", f"rollout.sglang.router_command=[{','.join(ROUTER)}]"]


@pytest.fixture
def signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_gpus_per_node_from_slurms_variables():
    assert _gpus_on_node({"SLURM_GPUS_PER_NODE": "h100:4"}) == 4  # the job's --gpus-per-node=TYPE:N
    assert _gpus_on_node({"SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "8"}) == 2  # the step's own first
    assert _gpus_on_node({"SLURM_GPUS_PER_NODE": "gpu:h100:8"}) == 8  # the count is after the last colon
    assert _gpus_on_node({}) == 0
    assert world_from_env({}) == (["node0"], 8, 0)  # no Slurm, no flags: one host of 8


def test_a_trainer_rank_recomputes_the_launchers_plan():
    cfg = load_config(None, DISAGG)
    plan = placement_for_config(cfg, ["r1", "t1", "t2"], 4, rollout_nodes=1)
    env = plan_env(plan)
    assert env == {"MEGATRON_RL_HOSTS": "r1,t1,t2", "MEGATRON_RL_GPUS_PER_NODE": "4", "MEGATRON_RL_ROLLOUT_NODES": "1"}
    assert placement_for_run(cfg, 8, env) == plan
    colocated = load_config(None, ["rollout.engine=sglang", "rollout.sglang.tp_size=2"])
    two = placement_for_config(colocated, ["a", "b"], 2)
    assert plan_env(two)["MEGATRON_RL_ROLLOUT_NODES"] == "0" and placement_for_run(colocated, 4, plan_env(two)) == two
    # no launcher (a plain torchrun): every rank on one host, the servers' interface
    alone = placement_for_run(colocated, 2, {})
    assert [h.host for h in alone.hosts] == ["127.0.0.1"] and alone.world_size == 2
    with pytest.raises(ValueError) as err:
        placement_for_run(cfg, 12, env)
    assert str(err.value) == "the placement plan has 8 trainer ranks but torch.distributed started 12"


def test_this_host_is_slurms_node_name_or_its_node_id():
    plan = placement_for_config(load_config(None, []), ["a", "b", "c"], 1)
    assert this_host(plan, {"SLURMD_NODENAME": "b", "SLURM_NODEID": "0"}) == "b"
    assert this_host(plan, {"SLURM_NODEID": "2"}) == "c"
    assert this_host(plan, {}) == "a"
    with pytest.raises(ValueError) as err:
        this_host(plan, {"SLURMD_NODENAME": "z"})
    assert str(err.value) == "this host 'z' is not in the job's hosts ['a', 'b', 'c']"


@pytest.mark.parametrize("env, overrides, model", [
    ({"MEGATRON_RL_MODEL": "/env"}, ["rollout.sglang.model_path=/cfg", "model.hf_dir=/hf"], "/env"),
    ({}, ["rollout.sglang.model_path=/cfg", "model.hf_dir=/hf"], "/cfg"),
    ({}, ["model.hf_dir=/hf"], "/hf"),
    ({"MEGATRON_RL_MODEL": "/fp8"}, ["precision.rollout_quant=fp8_blockwise", "model.hf_dir=/hf"], "/fp8"),
])
def test_the_servers_model(env, overrides, model):
    assert serve_model(load_config(None, [*DISAGG, *overrides]), env) == model


def test_servers_without_a_checkpoint_say_what_to_set():
    with pytest.raises(ValueError) as err:
        serve_model(load_config(None, [*DISAGG, "precision.rollout_quant=fp8_blockwise", "model.hf_dir=/hf"]), {})
    assert str(err.value) == ("precision.rollout_quant=fp8_blockwise on disaggregated servers needs a block-FP8 "
                              "checkpoint: set rollout.sglang.model_path (or MEGATRON_RL_MODEL) to the output "
                              "of tools/convert_hf_to_fp8.py")
    with pytest.raises(ValueError) as err:
        serve_model(load_config(None, DISAGG), {})
    assert str(err.value) == "disaggregated servers need a checkpoint: set MEGATRON_RL_MODEL or model.hf_dir"


def test_the_router_host_runs_its_servers_then_the_router_with_every_servers_url():
    cfg = load_config(None, [*DISAGG, *COMMANDS, "train.seed=7"])
    plan = placement_for_config(cfg, ["r1", "r2", "t"], 8, rollout_nodes=2)
    router_host = next(h for h in plan.hosts if h.router_port is not None)
    argvs = serve_argvs(plan, router_host.host, cfg, "/m", "key-1")
    servers, router = argvs[:-1], argvs[-1]
    assert len(servers) == 2 and all(a[:1] == SERVER for a in servers)
    for i, argv in enumerate(servers):
        flags = dict(zip(argv[1::2], argv[2::2]))
        assert flags["--tp-size"] == "4" and flags["--host"] == router_host.host and flags["--api-key"] == "key-1"
        assert flags["--random-seed"] == str(7 + i) and flags["--port"] == str(31000 + i)
        assert flags["--base-gpu-id"] == str(4 * i)
    urls = [f"http://{h}:{31000 + i}" for h in ("r1", "r2") for i in range(2)]
    assert router[:2] == ROUTER
    assert router[router.index("--worker-urls") + 1:router.index("--worker-urls") + 5] == urls
    assert router[router.index("--port") + 1] == "31999" and router[router.index("--host") + 1] == router_host.host
    assert router[-2:] == ["--api-key", "key-1"]


def test_trainer_argv_runs_the_training_module_on_this_hosts_address():
    cfg = load_config(None, DISAGG)
    plan = placement_for_config(cfg, ["r1", "t1", "t2"], 8, rollout_nodes=1)
    argv = trainer_argv(plan, "t2", "c.yaml", ["a=1"])
    assert argv[:3] == [sys.executable, "-m", "megatron_rl.cluster.torchrun"]
    assert argv[argv.index("--local-addr") + 1] == "t2" and "--master-port=29500" in argv
    assert argv[-4:] == ["-m", "megatron_rl.train", "c.yaml", "a=1"]


def _run_main(monkeypatch, capsys, argv, env):
    for key in list(launch.os.environ):
        if key.startswith(("SLURM", "MEGATRON_RL_")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_main_dry_run_prints_the_plan(monkeypatch, capsys, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout:\n  engine: sglang\n  sglang:\n    tp_size: 2\n")
    env = {"SLURM_JOB_NODELIST": "g[1-2]", "SLURM_GPUS_ON_NODE": "4", "SLURMD_NODENAME": "g2"}
    for extra in ([], ["--role", "train"]):  # a dry run never starts anything, whatever the role
        code, out, err = _run_main(monkeypatch, capsys, [str(cfg_file), "--dry-run", *extra], env)
        plan = placement_for_config(load_config(cfg_file, []), ["g1", "g2"], 4)
        assert code == 0 and err == "" and json.loads(out) == json.loads(plan.to_json())
    code, out, err = _run_main(monkeypatch, capsys, [str(cfg_file), "--dry-run", "--nodes", "2", "--gpus-per-node",
                                                     "2"], {})
    assert code == 0 and json.loads(out)["world_size"] == 4


def test_main_names_a_bad_config_and_exits_2(monkeypatch, capsys, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("train:\n  nope: 1\n")
    code, out, err = _run_main(monkeypatch, capsys, [str(cfg_file), "--role", "train"], {"SLURMD_NODENAME": "x"})
    assert code == 2 and out == "" and err.startswith("megatron-rl launch: error: unknown config key 'train.nope'")


def test_main_role_train_runs_torchrun_with_the_plan_exported(monkeypatch, capsys, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout:\n  engine: sglang\n  sglang:\n    mode: disaggregated\n    weight_transport: nccl\n")
    ran = []
    monkeypatch.setattr(launch, "run_trainer", lambda argv, env: ran.append((argv, env)) or 5)
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_GPUS_ON_NODE": "2", "SLURMD_NODENAME": "n3",
           "MEGATRON_RL_ROLLOUT_NODES": "1", "MEGATRON_RL_MASTER_PORT": "29777"}
    code, out, err = _run_main(monkeypatch, capsys, [str(cfg_file), "train.lr=2e-6", "--role", "train"], env)
    plan = placement_for_config(load_config(cfg_file, []), ["n1", "n2", "n3"], 2, 1)
    assert code == 5 and out == "" and err == ""
    (argv, run_env), = ran
    assert argv == trainer_argv(plan, "n3", str(cfg_file), ["train.lr=2e-6"], 29777)
    assert {k: run_env[k] for k in plan_env(plan)} == plan_env(plan) and run_env["SLURMD_NODENAME"] == "n3"


def test_main_role_serve_runs_this_hosts_servers(monkeypatch, capsys, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"log:\n  dir: {tmp_path / 'run'}\nrollout:\n  engine: sglang\n  sglang:\n"
                        "    mode: disaggregated\n    weight_transport: nccl\n"
                        f"    server_command: [{SERVER[0]}]\n    router_command: [{ROUTER[0]}]\n")
    served = []
    monkeypatch.setattr(launch, "serve", lambda argvs, log_dir, host: served.append((argvs, log_dir, host)) or 0)
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "1", "SLURMD_NODENAME": "n1",
           "MEGATRON_RL_ROLLOUT_NODES": "1", "MEGATRON_RL_MODEL": "/ckpt", "MEGATRON_RL_SGLANG_API_KEY": "k9"}
    assert _run_main(monkeypatch, capsys, [str(cfg_file), "--role", "serve"], env)[0] == 0
    plan = placement_for_config(load_config(cfg_file, []), ["n1", "n2"], 1, 1)
    (argvs, log_dir, host), = served
    assert host == "n1" and log_dir == tmp_path / "run" / "sglang"
    assert argvs == serve_argvs(plan, "n1", load_config(cfg_file, []), "/ckpt", "k9")
    env["MEGATRON_RL_LOG_DIR"] = str(tmp_path / "elsewhere")
    _run_main(monkeypatch, capsys, [str(cfg_file), "--role", "serve"], env)
    assert served[-1][1] == tmp_path / "elsewhere"


def test_run_trainer_passes_its_env_and_status_and_a_sigterm_ends_the_child(tmp_path, signals):
    out = tmp_path / "seen"
    code = launch.run_trainer([sys.executable, "-c", f"import os, sys; open({str(out)!r}, 'w').write("
                                                     "os.environ['MARK']); sys.exit(3)"], {"MARK": "m1"})
    assert code == 3 and out.read_text() == "m1"
    started = tmp_path / "started"
    child = [sys.executable, "-c", f"import time; open({str(started)!r}, 'w').close(); time.sleep(60)"]

    def terminate_when_started():
        import os
        import time

        for _ in range(400):
            if started.exists():
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # what srun sends the task

    threading.Thread(target=terminate_when_started, daemon=True).start()
    assert launch.run_trainer(child, {}) == -signal.SIGTERM  # forwarded to torchrun, which died of it


def test_serve_returns_0_on_a_stop_request_and_makes_its_log_folder_once_more(tmp_path, signals):
    (tmp_path / "logs" / "h1").mkdir(parents=True)  # a requeued job's host folder is already there
    argvs = [[sys.executable, "-c", "import time; time.sleep(60)", "--port", "7"],
             ["/x/router", "-c", "import time; time.sleep(60)"]]
    argvs[1][0] = sys.executable

    def stop_soon():
        import os
        import time

        time.sleep(1.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_soon, daemon=True).start()
    assert launch.serve(argvs, tmp_path / "logs", "h1") == 0
    assert sorted(p.name for p in (tmp_path / "logs" / "h1").iterdir()) == ["server-1.log", "server-7.log"]


def test_main_reads_its_arguments_overrides_and_flags(monkeypatch, capsys, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout:\n  engine: sglang\n  sglang:\n    tp_size: 2\n    mode: disaggregated\n"
                        "    weight_transport: nccl\n")
    monkeypatch.setattr(sys, "argv", ["megatron_rl.cluster.launch", str(cfg_file), "rollout.sglang.tp_size=4",
                                      "--dry-run", "--nodes", "3", "--gpus-per-node", "4", "--rollout-nodes", "2"])
    code, out, _ = _run_main(monkeypatch, capsys, None, {})
    plan = json.loads(out)
    assert code == 0 and [len(h["servers"]) for h in plan["hosts"]] == [1, 1, 0]  # TP 4 of the override
    assert plan["world_size"] == 4  # one trainer host: the flag's 2 rollout hosts, not the default half


def test_main_role_train_defaults_to_port_29500(monkeypatch, capsys, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("train:\n  seed: 3\n")
    ran = []
    monkeypatch.setattr(launch, "run_trainer", lambda argv, env: ran.append(argv) or 0)
    env = {"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "2", "SLURMD_NODENAME": "n1"}
    assert _run_main(monkeypatch, capsys, [str(cfg_file), "--role", "train"], env)[0] == 0
    assert "--master-port=29500" in ran[0]


def test_main_role_serve_falls_back_to_the_configs_checkpoint(monkeypatch, capsys, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model:\n  hf_dir: {tmp_path / 'hf'}\nrollout:\n  engine: sglang\n  sglang:\n"
                        f"    mode: disaggregated\n    weight_transport: nccl\n    server_command: [{SERVER[0]}]\n"
                        f"    router_command: [{ROUTER[0]}]\n")
    served = []
    monkeypatch.setattr(launch, "serve", lambda argvs, log_dir, host: served.append(argvs) or 0)
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "1", "SLURMD_NODENAME": "n1",
           "MEGATRON_RL_ROLLOUT_NODES": "1", "MEGATRON_RL_SGLANG_API_KEY": "k9"}
    assert _run_main(monkeypatch, capsys, [str(cfg_file), "--role", "serve"], env)[0] == 0
    server = served[0][0]
    assert server[server.index("--model-path") + 1] == str(tmp_path / "hf")


def test_a_trainer_rank_reads_the_export_from_its_own_environment(monkeypatch):
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.tp_size=2"])
    for key in list(launch.os.environ):
        if key.startswith("MEGATRON_RL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("MEGATRON_RL_HOSTS", "a,b")
    monkeypatch.setenv("MEGATRON_RL_GPUS_PER_NODE", "2")  # no MEGATRON_RL_ROLLOUT_NODES: colocated, 0
    plan = placement_for_run(cfg, 4)
    assert [h.host for h in plan.hosts] == ["a", "b"] and plan.layout == "colocated"


def test_the_servers_run_with_sglangs_environment_defaults(tmp_path, signals):
    from megatron_rl.rollout.sglang_server import SERVER_ENV_DEFAULTS

    seen = tmp_path / "env.json"
    code = (f"import json, os; json.dump({{k: os.environ.get(k) for k in {sorted(SERVER_ENV_DEFAULTS)!r}}}, "
            f"open({str(seen)!r}, 'w'))")
    argvs = [[sys.executable, "-c", code, "--port", "5"]]
    assert launch.serve(argvs, tmp_path / "logs", "h1") == 1  # it exits at once: the step ends
    assert json.loads(seen.read_text()) == SERVER_ENV_DEFAULTS


def test_an_unknown_role_is_refused_by_the_launchers_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main([str(tmp_path / "c.yaml"), "--role", "bogus"])
    stderr = capsys.readouterr().err
    assert err.value.code == 2 and stderr.startswith("usage: megatron-rl launch")
    assert "argument --role: invalid choice: 'bogus'" in stderr and "'train'" in stderr


def test_torchrun_runs_in_its_own_session(tmp_path, signals):
    import os

    out = tmp_path / "sid"
    assert launch.run_trainer([sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write(str(os.getsid(0)))"],
                              {}) == 0
    assert int(out.read_text()) != os.getsid(0)  # srun's signal to this task's group does not reach it twice


def test_a_dead_router_ends_the_step_naming_its_log(tmp_path, capsys, signals):
    argvs = [[sys.executable, "-c", "import time; time.sleep(60)", "--port", "5"],
             [sys.executable, "-c", "import sys; sys.exit(1)  # the router", "--port", "6"]]
    assert launch.serve(argvs, tmp_path / "logs", "h1") == 1
    assert capsys.readouterr().err == f"h1: router-6 exited (see {tmp_path / 'logs' / 'h1'}); ending the serve step\n"
    assert sorted(p.name for p in (tmp_path / "logs" / "h1").iterdir()) == ["router-6.log", "server-5.log"]
