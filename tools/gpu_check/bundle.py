"""The carried Transformer Engine bundle (see the device call in docs/gpu_check/README.md): TE's
tarball and the megatron-core and torchao wheels, unpacked with Python's tarfile / zipfile (no xz
or pip there) into one folder that goes in front of PYTHONPATH.

Layout of a bundle folder: `te-*.tar.xz` (transformer_engine, transformer_engine_torch and TE's
import deps, laid out as `pip install --target` leaves them), `*.whl`, `te_smoke.py`.
"""

from __future__ import annotations

import glob
import os
import sys
import sysconfig
import tarfile
import zipfile

REQUIRED = ("transformer_engine", "megatron", "torchao")
"""Top-level packages the unpacked folder must hold."""


def _parts(bundle: str) -> tuple[str, list[str]]:
    tarballs = sorted(glob.glob(os.path.join(bundle, "te-*.tar.xz")))
    if len(tarballs) != 1:
        raise FileNotFoundError(f"{bundle}: expected one te-*.tar.xz, found {len(tarballs)}")
    return tarballs[0], sorted(glob.glob(os.path.join(bundle, "*.whl")))


def _kept(member: str) -> bool:
    """Wheel members to unpack: torchao's wheel ships a stray top-level test/ package."""
    return not member.startswith("test/")


def layout(bundle: str) -> dict:
    """Top-level names the bundle would unpack to, read without extracting."""
    tarball, wheels = _parts(bundle)
    with tarfile.open(tarball) as tar:
        top = {name.split("/")[0] for name in tar.getnames()}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            top |= {m.split("/")[0] for m in z.namelist() if _kept(m)}
    return _describe(bundle, tarball, wheels, top)


def unpack(bundle: str, dest: str) -> dict:
    """Extract the tarball and the wheels into dest; returns what layout() returns."""
    tarball, wheels = _parts(bundle)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="data")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(dest, [m for m in z.namelist() if _kept(m)])
    return _describe(bundle, tarball, wheels, set(os.listdir(dest)))


def _describe(bundle: str, tarball: str, wheels: list[str], top: set[str]) -> dict:
    missing = [p for p in REQUIRED if p not in top]
    tags = sorted({part for w in wheels for part in os.path.basename(w).split("-") if part.startswith("cp3")})
    return {"tarball": os.path.basename(tarball), "wheels": [os.path.basename(w) for w in wheels],
            "missing": missing, "stray_test_package": "test" in top, "python_tags": tags,
            "te_smoke": os.path.isfile(os.path.join(bundle, "te_smoke.py"))}


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def environment(dest: str, base: dict) -> dict:
    """The environment of the checks with the unpacked bundle: dest first on PYTHONPATH, and TE's
    NVRTC headers from the CUDA 13 runtime wheel torch brought (nvidia/cu13/include), when present."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (dest, base.get("PYTHONPATH", "")) if p)
    include = os.path.join(sysconfig.get_path("purelib"), "nvidia", "cu13", "include")
    if os.path.isdir(include):
        env.setdefault("NVTE_CUDA_INCLUDE_DIR", include)
    return env
