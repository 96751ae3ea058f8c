"""The tensor transport's CUDA payload, reopened in a second process as an SGLang TP rank would.

Runs without sglang (its patched reductions map devices by UUID; torch's own CUDA IPC reduction is
used here). Skipped without CUDA.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_rl.rollout.sglang_payload import flatten_bucket, serialize_flattened

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

READER = textwrap.dedent("""
    import base64, io, sys
    from multiprocessing.reduction import ForkingPickler
    import torch
    from megatron_rl.rollout.sglang_payload import unflatten_bucket
    data = ForkingPickler.loads(base64.b64decode(sys.stdin.read()))
    named = dict(unflatten_bucket(data["flattened_tensor"], data["metadata"]))
    w, s = named["a.weight"], named["a.weight_scale_inv"]
    assert w.is_cuda and w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    print(float(w.float().sum()), float(s.sum()))
""")


def test_cuda_ipc_payload_reopens_in_another_process():
    weight = torch.full((4, 8), 2.0, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5]], device="cuda")
    flat, meta = flatten_bucket([("a.weight", weight), ("a.weight_scale_inv", scale)])
    payload = serialize_flattened(flat, meta)  # `flat` stays alive: the reader maps its memory
    out = subprocess.run([sys.executable, "-c", READER], input=payload, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["64.0", "0.5"]
    torch.cuda.synchronize()
