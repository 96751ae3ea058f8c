"""The colocated tensor transport's trainer side, without a GPU and without sglang importable.

SGLang (its own environment, a server_command) rebuilds an IPC tensor with
sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified, which finds the device by the GPU's UUID
in argument 6 (_REDUCE_TENSOR_ARG_DEVICE_INDEX). The trainer must write exactly that with no sglang
to import. A CUDA tensor here is a tensor whose is_cuda says so, reduced by a stand-in of torch's
reduce_tensor that returns what torch's returns for CUDA storage (rebuild_cuda_tensor and its
15 arguments, torch/multiprocessing/reductions.py); the device's UUID comes from a table."""

from __future__ import annotations

import base64
import io
import pickle
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import reductions

import sglang_protocol as proto
from sglang_testing import needs_sglang_source

from megatron_rl.rollout import sglang_payload
from megatron_rl.sync.sglang_transport import SGLangTensorTransport

pytestmark = pytest.mark.timeout(120)
UUIDS = {1: "GPU-5f2c0d1e-0000-1111-2222-333344445555"}


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports is_cuda (ops on it return FakeCuda, so a flattened bucket is one)."""

    @property
    def is_cuda(self):
        return True


def cuda_args(tensor) -> tuple:
    """The arguments torch's reduce_tensor gives a CUDA tensor on device 1 (fixed handles)."""
    return (torch.Tensor, tensor.size(), tensor.stride(), 0, torch.UntypedStorage, tensor.dtype, 1, b"ipc-handle",
            tensor.numel(), 0, False, b"ref-counter", 0, b"event", True)


@pytest.fixture
def no_sglang(monkeypatch):
    """sglang not importable (SGLang in another environment), CUDA faked as described above."""
    allowed = proto.unpickler_allowed_globals() if proto.sglang_root() else None  # read before blocking
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang...` raises ImportError
    monkeypatch.setattr(reductions, "reduce_tensor",
                        lambda t: (reductions.rebuild_cuda_tensor, cuda_args(t)) if t.is_cuda else REDUCE(t))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=UUIDS[i]))
    return allowed


REDUCE = reductions.reduce_tensor


class SGLangSide(pickle.Unpickler):
    """What SGLang's SafeUnpickler sees: every global, and the rebuild call's arguments."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.globals, self.rebuilt = [], []

    def find_class(self, module, name):
        self.globals.append((module, name))
        if (module, name) == sglang_payload.SGLANG_CUDA_REBUILD:
            return lambda *args: self.rebuilt.append(args) or "rebuilt"
        return super().find_class(module, name)


class Engine:
    """The engine as the transport drives it: servers, and every POST recorded."""

    def __init__(self, num_servers: int = 1, barrier: threading.Barrier | None = None):
        self.servers = [SimpleNamespace(tp_size=1, down=False, url=f"s{i}") for i in range(num_servers)]
        self.posts, self.barrier = [], barrier

    def broadcast(self, path, body, servers):
        if self.barrier is not None:
            self.barrier.wait()  # returns only when every server's post is in flight at once
        self.posts.append((path, body, [s.url for s in servers]))
        return [{"success": True}]

    def note_sent(self, names):
        list(names)


def test_the_tensor_transport_sends_ipc_handles_sglang_rebuilds_without_sglang_here(no_sglang):
    engine = Engine()
    bucket = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3).as_subclass(FakeCuda)),
              ("b", torch.ones(2, dtype=torch.bfloat16).as_subclass(FakeCuda))]
    SGLangTensorTransport(engine).send(bucket, 3)
    ((path, body, targets),) = engine.posts
    assert (path, targets, body["weight_version"], body["load_format"]) == (
        "/update_weights_from_tensor", ["s0"], "3", "flattened_bucket")
    side = SGLangSide(base64.b64decode(body["serialized_named_tensors"][0]))
    got = side.load()
    assert got["flattened_tensor"] == "rebuilt"
    ((args,),) = [side.rebuilt]
    expected = list(cuda_args(torch.empty(6 * 4 + 2 * 2, dtype=torch.uint8)))
    expected[6] = UUIDS[1]  # the device by UUID, as sglang's _device_to_uuid writes it
    assert list(args) == expected
    assert [(m.name, m.start_idx, m.end_idx, m.dtype) for m in got["metadata"]] == [
        ("w", 0, 24, torch.float32), ("b", 24, 28, torch.bfloat16)]
    if no_sglang is not None:  # every global on SGLang 0.5.23's allow-list (utils/common.py SafeUnpickler)
        assert set(side.globals) <= no_sglang, set(side.globals) - no_sglang


def test_cpu_payloads_keep_torchs_own_shared_memory_rebuild(no_sglang):
    flat, meta = sglang_payload.flatten_bucket([("w", torch.ones(2, 2))])
    side = SGLangSide(base64.b64decode(sglang_payload.serialize_flattened(flat, meta)))
    got = side.load()
    assert sglang_payload.SGLANG_CUDA_REBUILD not in side.globals and side.rebuilt == []
    assert got["flattened_tensor"].equal(flat)


def test_one_cuda_payload_is_never_handed_to_servers_on_other_gpus(no_sglang):
    """No gather (PP > 1 stages, a lone owner rank): server 1 would open a handle of GPU 0's memory."""
    engine = Engine(num_servers=2)
    with pytest.raises(ValueError, match="2 colocated servers and one CUDA payload"):
        SGLangTensorTransport(engine).send([("w", torch.ones(4).as_subclass(FakeCuda))], 1)
    assert engine.posts == []


def test_each_bucket_goes_to_every_server_at_once():
    engine = Engine(num_servers=3, barrier=threading.Barrier(3, timeout=20))
    transport = SGLangTensorTransport(engine)
    for version in (1, 2):
        transport.send([("w", torch.full((4,), float(version)))], version)
    assert sorted(t for _, _, [t] in engine.posts) == ["s0", "s0", "s1", "s1", "s2", "s2"]


def test_colocated_tensor_transport_with_pp_over_1_on_gpus_is_refused_before_anything_is_built():
    from megatron_rl.config import load_config
    from megatron_rl.loop.build import check_colocated_ipc

    base = ["rollout.engine=sglang", "rollout.sglang.mode=colocated"]
    pp2 = load_config(None, [*base, "rollout.sglang.weight_transport=tensor",
                             "parallel.pipeline_model_parallel_size=2"])
    with pytest.raises(ValueError) as err:
        check_colocated_ipc(pp2, cuda=True)
    assert str(err.value) == (
        "config key 'parallel.pipeline_model_parallel_size': 2 with colocated SGLang and "
        "rollout.sglang.weight_transport=tensor would hand servers CUDA IPC handles of another GPU's memory; "
        "use rollout.sglang.weight_transport=disk, or PP 1")
    check_colocated_ipc(pp2, cuda=False)  # CPU tensors travel as shared-memory files: any server opens them
    disk = load_config(None, [*base, "rollout.sglang.weight_transport=disk", "rollout.sglang.disk_dir=/w",
                              "parallel.pipeline_model_parallel_size=2"])
    check_colocated_ipc(disk, cuda=True)
    check_colocated_ipc(load_config(None, [*base, "rollout.sglang.weight_transport=tensor"]), cuda=True)
