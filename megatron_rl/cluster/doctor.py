"""`megatron-rl doctor [CONFIG] [--json PATH]`: the environment check to run on a login or compute
node before submitting. One line per check, `STATUS  check  detail` with STATUS one of PASS, WARN,
FAIL (a blocker: the exit code is 1) or SKIP (not asked for by the config).

Checks: the installed packages against the GPU matrix (megatron_rl/stack.py), CUDA and the driver,
the GPU architecture and the FP8 recipes it runs natively, Transformer Engine and apex's fused
kernels, SGLang (importable, or `server_command` found) when the config rolls out with it, the
NCCL variables, the ports the config's servers and the rendezvous bind, and the filesystem of the
stop file (it must be shared: slurm/job.sh writes it on one node, rank 0 reads it on another).
Each check is a function of plain facts (versions, capability, paths) so tests can feed any machine.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_rl.stack import GPU_MATRIX, SUPPORTED, TE_REQUIREMENT, installed_version

STATUSES = ("PASS", "WARN", "FAIL", "SKIP")
# Native TE recipes by architecture (TE's recipe support; actor/settings.py check_device refuses
# mxfp8 / nvfp4 below compute capability 10.0).
HOPPER_RECIPES = ("delayed", "tensorwise", "blockwise")
BLACKWELL_RECIPES = HOPPER_RECIPES + ("mxfp8", "nvfp4")
# torch 2.14.1 from PyPI is built with CUDA 13.0, which needs a driver >= 580 (CUDA 13.0 release notes).
MIN_DRIVER_CUDA13 = 580
# Filesystems every node of a job sees the same (the stop file must be one of these).
SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "weka", "wekafs",
                      "glusterfs", "fuse.glusterfs", "fuse.juicefs", "panfs", "vast", "cifs", "smb3")


@dataclass(frozen=True)
class Check:
    status: str
    check: str
    detail: str

    def line(self) -> str:
        return f"{self.status}  {self.check}  {self.detail}"


@dataclass(frozen=True)
class Needs:
    """What the config asks of the machine."""

    te: bool = True  # the TE layer spec (parallel.transformer_impl auto / transformer_engine)
    sglang: bool = False  # rollout.engine=sglang with servers launched from here
    server_command: tuple[str, ...] = ()
    router: bool = False
    recipe: str = "bf16"  # precision.train_recipe
    ports: tuple[int, ...] = ()


def needs_of(cfg) -> Needs:
    """Needs of a RunConfig (None: the GPU stack's defaults, no SGLang)."""
    if cfg is None:
        return Needs(ports=(_master_port(),))
    sg = cfg.rollout.sglang
    launches = cfg.rollout.engine == "sglang" and not sg.server_urls
    ports = [_master_port()]
    if launches:
        ports += [sg.base_port + i for i in range(sg.num_servers)]
        ports += [sg.router_port] if sg.launch_router else []
    return Needs(te=cfg.parallel.transformer_impl != "local", sglang=launches,
                 server_command=tuple(sg.server_command), router=launches and sg.launch_router,
                 recipe=cfg.precision.train_recipe, ports=tuple(ports))


def _master_port() -> int:
    return int(os.environ.get("MEGATRON_RL_MASTER_PORT", "29500"))  # slurm/job.sh's default


def package_checks(found: dict[str, str | None], needs: Needs) -> list[Check]:
    """One check per matrix package; found: {distribution: installed version or None}."""
    return [_package(dist, found.get(dist), needs) for dist in GPU_MATRIX]


def _package(dist: str, version: str | None, needs: Needs) -> Check:
    pin = GPU_MATRIX[dist]
    name = f"package {dist}"
    if version is None:
        status, why = _missing(dist, needs)
        fix = (f"pip install --no-build-isolation -c constraints/gpu.txt '{TE_REQUIREMENT}'"
               if dist.startswith("transformer-engine") else
               f"pip install -c constraints/gpu.txt '{dist}=={pin}'")
        return Check(status, name, f"not installed ({why}); the matrix pins {pin}: {fix}")
    if dist in SUPPORTED and not SUPPORTED[dist].contains(version, prereleases=True):
        return Check("FAIL", name, f"{version} is outside the supported range {SUPPORTED[dist]} "
                                   f"(refused at start); the matrix pins {pin}")
    if dist == "sglang" and version != pin:
        return Check("FAIL" if needs.sglang else "WARN", name,
                     f"{version}: the engine speaks {pin} only (refused at start)")
    if version.split("+")[0] != pin:
        return Check("WARN", name, f"{version}, the matrix pins {pin}")
    return Check("PASS", name, version)


def _missing(dist: str, needs: Needs) -> tuple[str, str]:
    if dist in ("torch", "transformers", "megatron-core"):
        return "FAIL", "required"
    if dist.startswith("transformer-engine"):
        return ("FAIL", "the TE layer spec needs it") if needs.te else ("SKIP", "transformer_impl=local")
    if dist in ("sglang", "sglang-kernel", "flashinfer-python"):
        if needs.sglang and not needs.server_command:
            return "FAIL", "rollout.engine=sglang launches servers with this interpreter"
        return "SKIP", "SGLang not launched from this interpreter"
    if dist == "sglang-router":
        return ("FAIL", "rollout.sglang.launch_router") if needs.router else ("SKIP", "no router launched")
    return "WARN", "optional"


def cuda_check(cuda_available: bool, torch_version: str, torch_cuda: str | None) -> Check:
    if torch_cuda is None:
        return Check("FAIL", "cuda", f"torch {torch_version} is a CPU build (torch.version.cuda is "
                                     f"None): install the matrix's CUDA torch {GPU_MATRIX['torch']}")
    if not cuda_available:
        return Check("FAIL", "cuda", f"torch {torch_version} (CUDA {torch_cuda}) sees no GPU "
                                     f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; "
                                     f"run doctor on a compute node)")
    return Check("PASS", "cuda", f"torch {torch_version}, CUDA {torch_cuda}")


def driver_check(driver: str | None, torch_cuda: str | None) -> Check:
    """driver: nvidia-smi's driver_version (e.g. '580.65.06'), None without nvidia-smi."""
    if driver is None:
        return Check("FAIL", "driver", "nvidia-smi not found: no NVIDIA driver on this node")
    major = int(driver.split(".")[0])
    if torch_cuda and torch_cuda.startswith("13.") and major < MIN_DRIVER_CUDA13:
        return Check("FAIL", "driver", f"{driver} is too old for CUDA {torch_cuda} "
                                       f"(needs >= {MIN_DRIVER_CUDA13})")
    return Check("PASS", "driver", driver)


def supported_recipes(capability: tuple[int, int]) -> tuple[str, ...]:
    """The TE FP8/FP4 recipes a GPU of this compute capability runs natively."""
    if capability >= (10, 0):
        return BLACKWELL_RECIPES
    if capability >= (9, 0):
        return HOPPER_RECIPES
    return ()


def arch_check(capability: tuple[int, int] | None, name: str, recipe: str) -> Check:
    if capability is None:
        return Check("FAIL", "gpu_arch", "no GPU: FP8 recipes run emulated only (CPU)")
    recipes = supported_recipes(capability)
    arch = "Blackwell" if capability >= (10, 0) else "Hopper" if capability >= (9, 0) else "pre-Hopper"
    detail = (f"{name} sm_{capability[0]}{capability[1]} ({arch}): native recipes "
              f"{', '.join(recipes) or 'none (BF16 only)'}")
    if recipe not in ("bf16", "rowwise", "mxfp4") and recipe not in recipes:
        return Check("FAIL", "gpu_arch", f"{detail}; the config's precision.train_recipe={recipe} is not one")
    return Check("PASS", "gpu_arch", detail)


def kernel_checks(te_imports: bool, apex_wgrad: bool, needs: Needs) -> list[Check]:
    te = Check("PASS", "te_kernels", "transformer_engine.pytorch imports")
    if not te_imports:
        te = Check("FAIL" if needs.te else "SKIP", "te_kernels",
                   "transformer_engine.pytorch does not import with CUDA (TE layer spec, FP8 GEMMs)"
                   if needs.te else "transformer_impl=local")
    apex = Check("PASS", "apex_wgrad_fusion", "fused_weight_gradient_mlp_cuda imports")
    if not apex_wgrad:
        apex = Check("WARN", "apex_wgrad_fusion", "fused_weight_gradient_mlp_cuda missing (NVIDIA apex, "
                                                   "not PyPI's): gradient_accumulation_fusion stays off")
    return [te, apex]


def sglang_check(needs: Needs, import_error: str | None, which=shutil.which) -> Check:
    """import_error: why sglang's server arguments do not import here, None when they do."""
    if not needs.sglang:
        return Check("SKIP", "sglang", "the config launches no SGLang server from here")
    if needs.server_command:
        exe = needs.server_command[0]
        found = which(exe)
        if found is None:
            return Check("FAIL", "sglang", f"rollout.sglang.server_command: {exe!r} is not found on PATH")
        return Check("PASS", "sglang", f"server_command {exe} -> {found}")
    if import_error is not None:
        return Check("FAIL", "sglang", f"sglang does not import here ({import_error}) and "
                                       f"rollout.sglang.server_command is empty: install the matrix "
                                       f"(make setup EXTRAS=gpu) or set server_command")
    return Check("PASS", "sglang", "sglang.srt.server_args imports")


def nccl_check(env: dict[str, str], interfaces: set[str]) -> Check:
    """FAIL when NCCL_SOCKET_IFNAME names no interface of this node (NCCL's syntax: comma-separated
    prefixes, '=' for exact names, '^' to exclude: an exclusion list is not checked)."""
    names = sorted(k for k in env if k.startswith("NCCL_"))
    listed = ", ".join(f"{k}={env[k]}" for k in names) or "none set (NCCL picks interfaces itself)"
    wanted = env.get("NCCL_SOCKET_IFNAME", "")
    if wanted and not wanted.startswith("^"):
        exact = wanted.startswith("=")
        patterns = [p for p in wanted.lstrip("=").split(",") if p]
        if not any(i == p or (not exact and i.startswith(p)) for p in patterns for i in interfaces):
            return Check("FAIL", "nccl", f"NCCL_SOCKET_IFNAME={wanted} matches no interface of this "
                                         f"node ({', '.join(sorted(interfaces)) or 'none'})")
    return Check("PASS", "nccl", listed)


def port_checks(ports: tuple[int, ...], host: str = "0.0.0.0") -> list[Check]:
    out = []
    for port in sorted(set(ports)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError as err:
                out.append(Check("FAIL", f"port {port}", f"in use on this node ({err.strerror})"))
                continue
        out.append(Check("PASS", f"port {port}", "free"))
    return out


def stop_file_check(folder: Path, mounts: list[tuple[str, str]]) -> Check:
    """folder: where the stop file lives; mounts: (mount point, fs type) of /proc/mounts."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        return Check("FAIL", "stop_file", f"{existing} is not writable (stop file under {folder})")
    real = os.path.realpath(existing)
    point, fstype = max(((p, t) for p, t in mounts if real == p or real.startswith(p.rstrip("/") + "/")),
                        key=lambda m: len(m[0]), default=("/", "unknown"))
    if fstype in SHARED_FILESYSTEMS:
        return Check("PASS", "stop_file", f"{folder} on {fstype} ({point})")
    return Check("WARN", "stop_file", f"{folder} is on {fstype} ({point}), not a shared filesystem: other "
                                      f"nodes will not see the stop file (set MEGATRON_RL_LOG_ROOT)")


def stop_file_folder(env: dict[str, str]) -> Path:
    """Where slurm/job.sh puts the stop file: beside MEGATRON_RL_STOP_REQUEST, else the log root."""
    if env.get("MEGATRON_RL_STOP_REQUEST"):
        return Path(env["MEGATRON_RL_STOP_REQUEST"]).parent
    root = env.get("MEGATRON_RL_LOG_ROOT") or os.path.join(env.get("SLURM_SUBMIT_DIR", os.getcwd()), "logs")
    return Path(root)


def read_mounts(path: str = "/proc/mounts") -> list[tuple[str, str]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    return [(f[1].replace("\\040", " "), f[2]) for f in (line.split() for line in lines) if len(f) >= 3]


def run_checks(cfg=None) -> list[Check]:
    """Every check on this machine, for the RunConfig `cfg` (None: no config)."""
    import torch

    from megatron_rl.fp8.te_recipe import te_available, wgrad_fusion_available
    from megatron_rl.rollout._sglang import sglang_import_error

    needs = needs_of(cfg)
    cuda = torch.cuda.is_available()
    checks = package_checks({d: installed_version(d) for d in GPU_MATRIX}, needs)
    checks.append(cuda_check(cuda, torch.__version__, torch.version.cuda))
    checks.append(driver_check(_driver_version(), torch.version.cuda))
    capability = torch.cuda.get_device_capability() if cuda else None
    checks.append(arch_check(capability, torch.cuda.get_device_name() if cuda else "", needs.recipe))
    checks += kernel_checks(te_available(), wgrad_fusion_available(), needs)
    checks.append(sglang_check(needs, sglang_import_error() if needs.sglang else None))
    checks.append(nccl_check(dict(os.environ), set(os.listdir("/sys/class/net"))
                             if os.path.isdir("/sys/class/net") else set()))
    checks += port_checks(needs.ports)
    checks.append(stop_file_check(stop_file_folder(dict(os.environ)), read_mounts()))
    return checks


def _driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.split()[0] if out.split() else None


def report(checks: list[Check], json_path: str | None = None) -> int:
    """Print one line per check (and write them as a JSON list); 1 if any FAILed, else 0."""
    for check in checks:
        print(check.line())
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps([asdict(c) for c in checks], indent=1) + "\n")
    failed = [c.check for c in checks if c.status == "FAIL"]
    print(f"doctor: {len(failed)} blocker(s){': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0
