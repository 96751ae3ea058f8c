"""The supported GPU stack: one pinned matrix, read by the start gates and `megatron-rl doctor`.

`constraints/gpu.txt` is this matrix as pip constraints (tests/unit/test_stack.py checks they are
equal, and that setup.py's `gpu` / `modelopt` extras and docker/Dockerfile pin the same versions).
The matrix resolves as one environment for linux x86-64 / Python 3.12 (tests/unit/test_stack_resolve.py
runs uv's resolver on it, metadata only).

Why each pin (read from each package's own metadata):
- sglang 0.5.23: the one release rollout/sglang_engine.py speaks (update sessions). It pins
  torch==2.14.1, torchaudio==2.11.0, transformers==5.19.0, flashinfer_python[cu13]==0.7.2 and
  sglang-kernel==0.4.10; colocated servers run in the trainer's interpreter, so its pins bind
  the trainer too. Its x86-64 wheel is manylinux_2_34 (glibc >= 2.34).
- megatron-core 0.16.1: the release actor/megatron_compat.py patches by file:line. Its `dev` extra
  declares transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0: the TE range it is tested with.
- transformer-engine 2.11.0: the newest release inside that range (2.9.0, 2.10.0 and 2.11.0 all
  declare torch>=2.1 and take a CUDA 12 or 13 torch). Its torch extension
  (transformer-engine-torch, source only) builds against the installed
  torch, so it needs `pip install --no-build-isolation`; built against torch 2.14.1 (CUDA 13) it
  requires the CUDA 13 core, transformer-engine-cu13 (its setup.py picks the core by
  torch.version.cuda; the sdist's static metadata names cu12, which a resolver then also lists).
- sglang-router 0.3.2: the newest; it pins nothing the rest pins.
- nvidia-modelopt 0.47.0: the NVFP4 export (convert/hf_to_nvfp4.py). Plain, not `[hf]`: its `hf`
  extra caps transformers<5.15, which sglang's transformers==5.19.0 excludes; the export needs
  only torch, transformers, safetensors and requests (imported by modelopt, not declared) besides
  modelopt's own requirements; it ran with transformers 5.25.0 on CPU.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# distribution -> the exact version of the supported GPU stack (pip's normalized names).
GPU_MATRIX: dict[str, str] = {
    "torch": "2.14.1",
    "torchaudio": "2.11.0",
    "transformers": "5.19.0",
    "megatron-core": "0.16.1",
    "transformer-engine": "2.11.0",
    "transformer-engine-torch": "2.11.0",
    "transformer-engine-cu13": "2.11.0",
    "sglang": "0.5.23",
    "sglang-router": "0.3.2",
    "sglang-kernel": "0.4.10",
    "flashinfer-python": "0.7.2",
    "nvidia-modelopt": "0.47.0",
}

# The ranges the start gates accept (a container's own build may differ from the pin within them):
# megatron-core: the release the CPU layer follows; TE: megatron-core 0.16.1's `dev` extra.
SUPPORTED: dict[str, SpecifierSet] = {
    "megatron-core": SpecifierSet(">=0.16.1,<0.17"),
    "transformer-engine": SpecifierSet(">=2.9.0a0,<2.12.0"),
    "transformer-engine-torch": SpecifierSet(">=2.9.0a0,<2.12.0"),
}

# How the TE distributions are installed together (pip extras; not allowed in a constraints file).
TE_REQUIREMENT = f"transformer-engine[core_cu13,pytorch]=={GPU_MATRIX['transformer-engine']}"


CONSTRAINTS_HEADER = ("# The supported GPU stack (megatron_rl/stack.py GPU_MATRIX); regenerate with\n"
                      "#   python -m megatron_rl.stack > constraints/gpu.txt\n")


def constraints_text() -> str:
    """constraints/gpu.txt: the header, then one `name==version` line per matrix entry, sorted."""
    lines = [f"{name}=={GPU_MATRIX[name]}" for name in sorted(GPU_MATRIX)]
    return CONSTRAINTS_HEADER + "\n".join(lines) + "\n"


def installed_version(dist: str) -> str | None:
    """The installed version of distribution `dist`, None when it is not installed."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def check_supported(dist: str, found: str | None = None) -> None:
    """Refuse `dist` outside SUPPORTED[dist] with the fix (found: the installed version, default
    read from the environment; a distribution that is not installed passes: nothing to refuse)."""
    found = installed_version(dist) if found is None else found
    if found is None:
        return
    spec = SUPPORTED[dist]
    if not spec.contains(Version(found), prereleases=True):  # TE's own builds: 2.10.0+769ed77
        raise RuntimeError(f"{dist} {found} is outside megatron_rl's supported range {spec} "
                           f"(the GPU matrix pins {GPU_MATRIX[dist]}); pip install "
                           f"-c constraints/gpu.txt '{dist}=={GPU_MATRIX[dist]}'")


def matrix_mismatches(found: dict[str, str | None]) -> list[str]:
    """'dist: found X, the matrix pins Y' for every matrix package not at its pin (a local version
    suffix such as torch's +cu130 is ignored); found: {distribution: version or None}."""
    out = []
    for dist, pin in GPU_MATRIX.items():
        have = found.get(dist)
        if have is None or Version(have).public != Version(pin).public:
            out.append(f"{dist}: found {have or 'nothing'}, the matrix pins {pin}")
    return out


def main(argv: list[str]) -> int:
    """No argument: print constraints/gpu.txt. --check: exit 1 naming every installed package that
    is not at its pin (docker/Dockerfile runs it after installing)."""
    if argv == ["--check"]:
        bad = matrix_mismatches({dist: installed_version(dist) for dist in GPU_MATRIX})
        for line in bad:
            print(f"megatron_rl.stack: {line}")
        return 1 if bad else 0
    if argv:
        raise SystemExit(f"usage: python -m megatron_rl.stack [--check], got {argv}")
    print(constraints_text(), end="")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
