"""tools/gpu_check.sh without a GPU: its dry mode, its bundle handling, its budget, its summary.

The dry mode runs every check up to its first CUDA use (configs, TE recipe fields, payloads, the
emulation's operands, the plan, the tiny loop's overrides) and the whole tcp:// start from a torchrun
worker and the IPC sync protocol on CPU; the GPU call is then not spent on a typo.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check"
LINE = re.compile(r"^(PASS|FAIL|SKIP) (\S+) (\{.*\})$")
sys.path.insert(0, str(TOOL))


def _add(tar: tarfile.TarFile, name: str, text: str = "") -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_bundle(folder: Path, *, torchao: bool = True, tag: str = "cp312") -> Path:
    """A bundle laid out as the real one, with stub packages: the TE tarball (+ one of TE's deps), the
    megatron-core wheel and torchao's wheel with its stray top-level test/ package."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "te-2.11.0-cu13-torch2.11-cp312-sm90.tar.xz", "w:xz") as tar:
        _add(tar, "transformer_engine/__init__.py", "__version__ = '2.11.0'\n")
        _add(tar, "transformer_engine/pytorch/__init__.py")
        _add(tar, "einops/__init__.py")
    with zipfile.ZipFile(folder / f"megatron_core-0.16.1-{tag}-{tag}-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr("megatron/core/__init__.py", "")
        z.writestr("megatron_core-0.16.1.dist-info/METADATA", "Name: megatron-core\n")
    if torchao:
        with zipfile.ZipFile(folder / "torchao-0.18.0-py3-none-any.whl", "w") as z:
            z.writestr("torchao/__init__.py", "")
            z.writestr("test/test_stray.py", "raise SystemExit('must not be unpacked')\n")
    (folder / "te_smoke.py").write_text("print('TE_SMOKE PASS')\n")
    return folder


def run_tool(*args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    out = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - start


def lines(stdout: str) -> dict[str, tuple[str, dict]]:
    found = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m:
            assert m.group(2) not in found, f"two lines for {m.group(2)}"
            found[m.group(2)] = (m.group(1), json.loads(m.group(3)))
    return found


def test_bundle_unpacks_with_tarfile_and_zipfile_leaving_the_stray_test_package_out(tmp_path):
    import bundle

    folder = make_bundle(tmp_path / "b")
    dest = tmp_path / "site"
    got = bundle.unpack(str(folder), str(dest))
    assert (dest / "transformer_engine" / "pytorch" / "__init__.py").is_file()
    assert (dest / "megatron" / "core" / "__init__.py").is_file() and (dest / "torchao" / "__init__.py").is_file()
    assert (dest / "einops" / "__init__.py").is_file()
    assert not (dest / "test").exists()
    assert got["missing"] == [] and got["stray_test_package"] is False and got["te_smoke"] is True
    assert got["python_tags"] == ["cp312"]
    listed = bundle.layout(str(folder))  # read without extracting: the same verdict
    assert {k: listed[k] for k in ("missing", "stray_test_package", "wheels")} == \
           {k: got[k] for k in ("missing", "stray_test_package", "wheels")}
    env = bundle.environment(str(dest), {"PYTHONPATH": "repo"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(dest), "repo"]


def test_bundle_names_what_is_missing(tmp_path):
    import bundle

    assert bundle.layout(str(make_bundle(tmp_path / "a", torchao=False)))["missing"] == ["torchao"]
    with pytest.raises(FileNotFoundError, match="expected one te-"):
        bundle.layout(str(tmp_path))


def test_performance_table_shows_only_measured_numbers_with_the_device():
    import main

    ratios = dict.fromkeys(main.RATIOS)
    ratios["train_fp8_over_bf16_tokens_per_s"] = 1.4567
    ratios["weight_sync_ipc_s_per_gb"] = 0.0123
    table = main.performance_table(ratios, {"name": "NVIDIA H200"}).splitlines()
    assert table[0].startswith("| measured") and table[1] == "|---|---|---|"
    assert table[2:] == [f"| {main.RATIOS['train_fp8_over_bf16_tokens_per_s']} | 1.46 | NVIDIA H200 |",
                         f"| {main.RATIOS['weight_sync_ipc_s_per_gb']} | 0.0123 | NVIDIA H200 |"]
    assert len(main.performance_table(dict.fromkeys(main.RATIOS), None).splitlines()) == 2  # header only


def test_dry_run_runs_each_checks_cpu_part_and_writes_the_summary(tmp_path):
    out_dir = tmp_path / "out"
    only = "bundle,te_smoke,numerics,te_path,plan_peak,perf,ipc_tensor_sync,offload_mem_get_info,cuda_graph_inplace,tiny_loop"
    out, _ = run_tool("--dry-run", "--out", str(out_dir), "--bundle", str(make_bundle(tmp_path / "b")),
                      "--only", only)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    import main

    expected = {"bundle", "te_smoke", "ipc_tensor_sync", "offload_mem_get_info", "cuda_graph_inplace", "tiny_loop"}
    expected |= {c.name for g in ("numerics", "te_path", "plan_peak", "perf") for c in main.group_checks(g)}
    seen = lines(out.stdout)
    assert set(seen) == expected
    # What runs whole on CPU passes; everything else reached its CUDA part and skipped there.
    assert {n for n, (s, _) in seen.items() if s == "PASS"} == {"bundle", "ipc_tensor_sync"}
    skipped = {n: d["reason"] for n, (s, d) in seen.items() if s == "SKIP"}
    assert set(skipped) == expected - {"bundle", "ipc_tensor_sync"}
    assert all(r.startswith("dry-run: CPU-side part ran") for r in skipped.values()), skipped
    summary = json.loads((out_dir / "gpu_check.json").read_text())
    assert summary["schema"] == 1 and summary["dry_run"] is True and summary["device"] is None
    assert summary["counts"] == {"PASS": 2, "FAIL": 0, "SKIP": len(expected) - 2}
    assert summary["ratios"] == dict.fromkeys(main.RATIOS)  # nothing measured without a GPU
    assert {n: c["status"] for n, c in summary["checks"].items()} == {n: s for n, (s, _) in seen.items()}
    assert summary["checks"]["ipc_tensor_sync"]["detail"]["mismatched_buckets"] == 0
    assert summary["checks"]["bundle"]["detail"]["import"].startswith("skipped: the bundle is for cp312")
    assert (out_dir / "performance.md").read_text().count("\n") == 2
    assert sorted((out_dir / "gpu_check.txt").read_text().splitlines()) == sorted(
        ln for ln in out.stdout.splitlines() if LINE.match(ln))  # groups ran at once: any order
    assert len(list(out_dir.iterdir())) <= 8  # what the device call brings back: 8 files at most


def test_dry_run_imports_the_bundle_where_it_matches_this_python(tmp_path):
    """The stub bundle, tagged for this interpreter, is unpacked and imported in front of everything
    else (its stub megatron shadows the installed one)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    out, _ = run_tool("--dry-run", "--out", str(tmp_path / "o"), "--bundle", str(make_bundle(tmp_path / "b", tag=tag)),
                      "--only", "bundle")
    status, detail = lines(out.stdout)["bundle"]
    assert status == "PASS" and detail["import"] == "ok: TE 2.11.0", detail
    broken = make_bundle(tmp_path / "c", tag=tag)
    with zipfile.ZipFile(broken / "torchao-0.18.0-py3-none-any.whl", "w") as z:
        z.writestr("torchao/__init__.py", "raise ImportError('torchao stub is broken')\n")
    out, _ = run_tool("--dry-run", "--out", str(tmp_path / "p"), "--bundle", str(broken), "--only", "bundle")
    status, detail = lines(out.stdout)["bundle"]
    assert status == "FAIL" and "torchao stub is broken" in detail["import"]


def test_a_server_started_from_a_torchrun_worker_joins_over_tcp(tmp_path):
    """The colocated start blocker, end to end on CPU (gloo): torchrun worker -> server process with the
    project's server environment -> init_process_group(tcp://) and the weight group's broadcast."""
    out, _ = run_tool("--dry-run", "--out", str(tmp_path), "--only", "tcp_spawn")
    status, detail = lines(out.stdout)["tcp_spawn"]
    assert status == "PASS", detail
    assert detail["lines"][-1] == "WORKER OK 523776.0 server_rc=0"  # sum(range(1024)) arrived


def test_a_check_past_its_timeout_fails_and_the_summary_is_written(tmp_path):
    out, _ = run_tool("--dry-run", "--jobs", "1", "--out", str(tmp_path), "--only", "cuda_graph_inplace,emulation_on_cuda",
                      "--stall", "cuda_graph_inplace=120", "--check-timeout", "8")
    seen = lines(out.stdout)
    assert out.returncode == 1
    assert seen["cuda_graph_inplace"][0] == "FAIL"
    assert seen["cuda_graph_inplace"][1]["error"].startswith("CheckTimeout: timed out after 8 s")
    assert 8 <= seen["cuda_graph_inplace"][1]["seconds"] < 20
    assert seen["emulation_on_cuda"][0] == "SKIP"  # the next group still ran
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["counts"] == {"PASS": 0, "FAIL": 1, "SKIP": 1}


def test_the_call_stops_itself_inside_its_budget(tmp_path):
    """A group that outlives its share of the budget is killed (with what it started) and its checks
    FAIL; the group after it still gets its floor of time and runs; the summary is written."""
    import main

    budget = 40
    out, seconds = run_tool("--dry-run", "--jobs", "1", "--out", str(tmp_path), "--budget", str(budget),
                            "--only", "cuda_graph_inplace,plan_peak_local", "--stall", "cuda_graph_inplace=300")
    seen = lines(out.stdout)
    share = budget - main.GROUP_TIME["plan_peak"][1]  # 15 s for the colocated group
    assert out.returncode == 1 and seconds < budget + 10
    assert seen["cuda_graph_inplace"] == ("FAIL", {"error": f"killed at the group's limit of {share} s (budget)"})
    assert seen["plan_peak_local"][0] == "SKIP"
    assert seen["plan_peak_local"][1]["reason"].startswith("dry-run: CPU-side part ran")
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["elapsed_s"] < budget and summary["counts"] == {"PASS": 0, "FAIL": 1, "SKIP": 1}


def test_a_group_with_no_time_left_is_not_started(tmp_path):
    out, _ = run_tool("--dry-run", "--out", str(tmp_path), "--budget", "5", "--only", "cuda_graph_inplace")
    status, detail = lines(out.stdout)["cuda_graph_inplace"]
    assert status == "SKIP" and re.fullmatch(r"budget: [45] s left of 5", detail["reason"])
    assert json.loads((tmp_path / "gpu_check.json").read_text())["counts"]["SKIP"] == 1


@pytest.mark.parametrize("args, message", [
    (["--only", "te_path,no_such_check"], "unknown groups or checks ['no_such_check']"),
    (["--budget", "0"], "--budget must be > 0"),
    (["--stall", "cuda_graph_inplace"], "expected CHECK=SECONDS"),
    (["--jobs", "-1"], "--jobs must be >= 1"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    out, _ = run_tool("--dry-run", "--out", str(tmp_path / "o"), *args, timeout=60)
    assert out.returncode == 2 and message in out.stderr
    assert not (tmp_path / "o").exists()


def test_groups_run_at_once_only_in_the_dry_mode(tmp_path):
    out, _ = run_tool("--jobs", "2", "--out", str(tmp_path / "o"), timeout=60)
    assert out.returncode == 2 and "the dry mode only" in out.stderr
