"""The loop, sync, checkpoint and build modules reach torch.distributed only through megatron_rl.collectives;
algo/ never reaches it at all (it takes a reducer). import-linter checks the other import rules
(.importlinter), but it sees external packages only by their top-level name, so torch.distributed
is checked here."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "megatron_rl"
# Host-side code: metrics, histograms, rewards, samples and barriers go through the helper, which
# puts each tensor on the device the group's backend needs. (actor/, models/ and fp8/ keep their
# device-side model collectives.)
HOST_SIDE = ["train.py", "loop", "telemetry", "cluster", "sync", "rollout", "rewards", "data", "algo"]


# Not host-side collectives, each for a reason: the torchrun wrapper drives torch's own elastic
# launcher and hosts its rendezvous TCPStore (cluster/torchrun.py), which is torch.distributed's API.
EXEMPT = {"cluster/torchrun.py"}


def _host_files():
    for entry in HOST_SIDE:
        path = PKG / entry
        assert path.exists(), f"HOST_SIDE names {entry}, which is gone: follow the move"
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        yield from (f for f in files if str(f.relative_to(PKG)) not in EXEMPT)


def _direct_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found.append(node.module)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "distributed" and getattr(node.value.value, "id", "") == "torch":
                found.append(f"torch.distributed.{node.attr}")
    return found


@pytest.mark.parametrize("path", list(_host_files()), ids=lambda p: str(p.relative_to(PKG)))
def test_host_side_modules_use_the_collectives_helper(path):
    assert _direct_uses(path) == [], f"{path.name} calls torch.distributed directly: use megatron_rl.collectives"


def test_the_check_sees_a_direct_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nimport torch\ntorch.distributed.barrier()\n")
    assert _direct_uses(bad) == ["torch.distributed", "torch.distributed.barrier"]


@pytest.mark.timeout(60, method="thread")  # the store's wait is C++: a signal would wait for it
def test_a_weight_group_nobody_joins_fails_after_its_own_timeout():
    """SGLang servers that never join: the trainer's side gives up after the timeout it was given
    (the job's), not torch's default store timeout of 5 minutes."""
    import time
    from datetime import timedelta

    from torch.distributed import DistStoreError

    from sglang_testing import free_port_block

    from megatron_rl import collectives

    start = time.monotonic()
    with pytest.raises(DistStoreError, match="clients joined"):
        collectives.rendezvous_group_as_rank0("127.0.0.1", free_port_block(1), 2, "megatron_rl_weights_9", "gloo",
                                              timedelta(seconds=2))
    assert time.monotonic() - start < 30
