"""`megatron-rl doctor` on a real GPU node: the architecture, driver and kernels it reports are the
ones torch and nvidia-smi report (skips without CUDA)."""

import shutil

import pytest
import torch

from megatron_rl.cluster import doctor
from megatron_rl.fp8.te_recipe import te_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_doctor_reports_this_gpu():
    checks = {c.check: c for c in doctor.run_checks(None)}
    major, minor = torch.cuda.get_device_capability()
    assert checks["cuda"].status == "PASS"
    assert f"sm_{major}{minor}" in checks["gpu_arch"].detail
    expected = {(9, 0): "delayed, tensorwise, blockwise"}.get((major, minor))
    if expected:
        assert checks["gpu_arch"].detail.endswith(f"native recipes {expected}")
    assert checks["driver"].status == ("PASS" if shutil.which("nvidia-smi") else "FAIL")
    assert (checks["te_kernels"].status == "PASS") == te_available()
