"""`megatron-rl doctor`: what it says on this CPU machine (and its exit code), and each check fed
the facts of other machines (a Hopper or Blackwell capability, an old driver, a TE outside the
range, a busy port, a local filesystem under the stop file)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from megatron_rl.actor.settings import check_device, plain_settings
from megatron_rl.cluster import doctor
from megatron_rl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(PASS|WARN|FAIL|SKIP)  (\S[^ ]*(?: \S+)?)  (\S.*)$")


def _doctor(*args, env=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "doctor", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU machine is told")
def test_on_this_cpu_machine_doctor_names_the_blockers_and_exits_1(tmp_path):
    run = _doctor("--json", str(tmp_path / "out" / "doctor.json"),
                  env={"MEGATRON_RL_LOG_ROOT": str(tmp_path / "logs")})
    assert run.returncode == 1, run.stderr
    lines = run.stdout.splitlines()
    parsed = [LINE.match(line) for line in lines[:-1]]
    assert all(parsed), [line for line, m in zip(lines, parsed) if not m]
    status = {m.group(2): m.group(1) for m in parsed}
    # Expected from facts read here independently of doctor: a CPU torch, no nvidia-smi, no TE.
    assert torch.version.cuda is None
    assert status["cuda"] == "FAIL" and "CPU build" in run.stdout
    assert status["driver"] == ("FAIL" if shutil.which("nvidia-smi") is None else "PASS")
    assert status["gpu_arch"] == "FAIL"
    assert status["te_kernels"] == "FAIL"
    if find_spec("transformer_engine") is None:
        assert status["package transformer-engine"] == status["package transformer-engine-torch"] == "FAIL"
    assert status["package megatron-core"] == "PASS"  # 0.16.1 here, the matrix's pin
    assert status["package torch"] == "WARN"  # 2.13.0+cpu, the matrix pins 2.14.1
    assert status["sglang"] == "SKIP"  # no config: no server launched from here
    fails = sorted(k for k, v in status.items() if v == "FAIL")
    assert lines[-1] == f"doctor: {len(fails)} blocker(s): " + ", ".join(
        k for k in status if status[k] == "FAIL")
    written = json.loads((tmp_path / "out" / "doctor.json").read_text())
    assert [f"{c['status']}  {c['check']}  {c['detail']}" for c in written] == lines[:-1]


def test_a_config_asking_for_sglang_adds_its_checks_and_ports(tmp_path):
    run = _doctor("--json", str(tmp_path / "d.json"), "rollout.engine=sglang",
                  "rollout.sglang.num_servers=2", "rollout.sglang.launch_router=true",
                  "rollout.sglang.server_command=[no-such-sglang-xyz]")
    checks = {c["check"]: c for c in json.loads((tmp_path / "d.json").read_text())}
    assert checks["sglang"]["status"] == "FAIL" and "'no-such-sglang-xyz' is not found" in checks["sglang"]["detail"]
    assert {"port 30000", "port 30001", "port 30999", "port 29500"} <= set(checks)
    # server_command runs SGLang from elsewhere: its kernels need not be installed here
    assert checks["package sglang-kernel"]["status"] in ("SKIP", "PASS", "WARN")
    assert run.returncode == 1


def test_a_bad_config_key_is_exit_2_naming_it():
    run = _doctor("rollout.sglang.num_servres=2")
    assert run.returncode == 2 and "num_servres" in run.stderr


@pytest.mark.parametrize("capability, recipes", [
    ((8, 0), ()), ((9, 0), ("delayed", "tensorwise", "blockwise")),
    ((10, 0), ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")),
    ((12, 0), ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4"))])
def test_gpu_capability_maps_to_its_native_recipes(capability, recipes):
    assert doctor.supported_recipes(capability) == recipes


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "blockwise", "delayed"])
def test_arch_check_agrees_with_the_actors_build_gate(capability, recipe):
    check = doctor.arch_check(capability, "GPU", recipe)
    try:
        check_device(plain_settings(transformer_impl="transformer_engine", cuda=True), recipe, capability)
        refused = False
    except ValueError:
        refused = True
    assert (check.status == "FAIL") == refused
    if refused:
        assert f"precision.train_recipe={recipe} is not one" in check.detail


def test_arch_detail_names_the_architecture_and_recipes():
    assert doctor.arch_check((9, 0), "NVIDIA H100", "blockwise").detail == (
        "NVIDIA H100 sm_90 (Hopper): native recipes delayed, tensorwise, blockwise")
    assert doctor.arch_check((10, 0), "NVIDIA B200", "nvfp4").line() == (
        "PASS  gpu_arch  NVIDIA B200 sm_100 (Blackwell): native recipes delayed, tensorwise, "
        "blockwise, mxfp8, nvfp4")
    assert doctor.arch_check((8, 0), "A100", "bf16").status == "PASS"


def test_package_checks_against_the_matrix():
    found = {"torch": "2.14.1", "transformers": "5.19.0", "megatron-core": "0.16.1",
             "transformer-engine": "2.12.0", "transformer-engine-torch": "2.10.0+769ed77",
             "sglang": "0.5.22", "sglang-kernel": None}
    checks = {c.check: c for c in doctor.package_checks(found, doctor.Needs(te=True, sglang=True))}
    assert checks["package torch"].status == "PASS"
    assert checks["package transformer-engine"].status == "FAIL"
    assert "2.12.0 is outside the supported range" in checks["package transformer-engine"].detail
    assert checks["package transformer-engine-torch"].status == "WARN"  # in range, not the pin
    assert checks["package sglang"].status == "FAIL"  # the engine refuses it at start
    assert checks["package sglang-kernel"].status == "FAIL"
    assert checks["package transformer-engine-cu13"].detail.endswith(
        "pip install --no-build-isolation -c constraints/gpu.txt "
        "'transformer-engine[core_cu13,pytorch]==2.11.0'")
    relaxed = {c.check: c.status for c in doctor.package_checks(
        {**found, "transformer-engine": None}, doctor.Needs(te=False, sglang=False))}
    assert relaxed["package transformer-engine"] == "SKIP"
    assert relaxed["package sglang"] == "WARN" and relaxed["package sglang-kernel"] == "SKIP"
    assert relaxed["package megatron-core"] == "PASS"
    missing_core = doctor.package_checks({}, doctor.Needs(te=False))
    assert {c.check for c in missing_core if c.status == "FAIL"} == {
        "package torch", "package transformers", "package megatron-core"}


@pytest.mark.parametrize("driver, cuda, status", [
    ("575.57.08", "13.0", "FAIL"), ("580.65.06", "13.0", "PASS"), ("575.57.08", "12.8", "PASS"),
    (None, "13.0", "FAIL")])
def test_driver_against_torchs_cuda(driver, cuda, status):
    assert doctor.driver_check(driver, cuda).status == status


@pytest.mark.parametrize("ifname, status", [("ib", "FAIL"), ("eth", "PASS"), ("=eth", "FAIL"),
                                            ("=eth0", "PASS"), ("ib,eth1", "PASS"), ("^docker", "PASS")])
def test_nccl_socket_ifname_must_match_an_interface(ifname, status):
    check = doctor.nccl_check({"NCCL_SOCKET_IFNAME": ifname, "NCCL_DEBUG": "WARN"}, {"lo", "eth0", "eth1"})
    assert check.status == status
    if status == "PASS":
        assert check.detail == f"NCCL_DEBUG=WARN, NCCL_SOCKET_IFNAME={ifname}"


def test_a_busy_port_fails_and_a_free_one_passes():
    with socket.socket() as busy, socket.socket() as probe:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        probe.bind(("0.0.0.0", 0))
        free = probe.getsockname()[1]
        probe.close()
        taken = busy.getsockname()[1]
        checks = {c.check: c.status for c in doctor.port_checks((taken, free, taken))}
    assert checks == {f"port {taken}": "FAIL", f"port {free}": "PASS"}


def test_stop_file_must_be_on_a_shared_filesystem(tmp_path):
    folder = tmp_path / "logs" / "job-1"  # not created yet: its nearest existing parent is checked
    shared = doctor.stop_file_check(folder, [("/", "ext4"), (str(tmp_path), "nfs4")])
    assert shared.status == "PASS" and shared.detail == f"{folder} on nfs4 ({tmp_path})"
    local = doctor.stop_file_check(folder, [("/", "overlay"), (str(tmp_path) + "x", "lustre")])
    assert local.status == "WARN" and "overlay" in local.detail
    env = {"MEGATRON_RL_STOP_REQUEST": "/shared/logs/j-3/stop-requested", "MEGATRON_RL_LOG_ROOT": "/x"}
    assert doctor.stop_file_folder(env) == Path("/shared/logs/j-3")
    assert doctor.stop_file_folder({"MEGATRON_RL_LOG_ROOT": "/x"}) == Path("/x")
    assert doctor.stop_file_folder({"SLURM_SUBMIT_DIR": "/home/u/rl"}) == Path("/home/u/rl/logs")


def test_needs_follow_the_config():
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.num_servers=3",
                             "rollout.sglang.base_port=31000", "parallel.transformer_impl=local"])
    needs = doctor.needs_of(cfg)
    assert needs.sglang and not needs.te and not needs.router
    assert needs.ports == (29500, 31000, 31001, 31002)
    remote = doctor.needs_of(load_config(None, ["rollout.engine=sglang",
                                                "rollout.sglang.server_urls=[http://n1:30000]"]))
    assert not remote.sglang and remote.ports == (29500,)


def test_the_gpu_check_interface_json_then_a_yaml_config(tmp_path):
    # tools/gpu_check.sh calls exactly `megatron-rl doctor --json $OUT/doctor.json CONFIG`.
    out = tmp_path / "out" / "doctor.json"
    run = _doctor("--json", str(out), "examples/qwen3_8b_grpo/fp8_calibrated.yaml")
    checks = {c["check"]: c for c in json.loads(out.read_text())}
    assert set(checks) >= {"cuda", "driver", "gpu_arch", "te_kernels", "apex_wgrad_fusion", "sglang",
                           "nccl", "stop_file", "package transformer-engine", "port 29500"}
    assert all(c["status"] in doctor.STATUSES for c in checks.values())
    assert checks["package megatron-core"]["status"] == "PASS"
    assert run.returncode == (1 if any(c["status"] == "FAIL" for c in checks.values()) else 0)
