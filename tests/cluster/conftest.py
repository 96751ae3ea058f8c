"""The test cluster every test here shares: one real two-node Slurm per test run (slurm_cluster.py).

Without Slurm (or without root) the tests here skip and say how to enable them; under CI=true that
skip is a failure: CI installs slurm-wlm and munge (.ci/run) and must run them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import SlurmCluster, missing  # noqa: E402


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    why = missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the Slurm test cluster cannot start: {why}")
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def cluster(slurm):
    """The shared cluster, with both nodes idle and up again before each test."""
    for node, state in slurm.node_states().items():
        if state.startswith(("down", "drain")):
            slurm.scontrol("update", f"nodename={node}", "state=resume")
    slurm.wait_idle()
    return slurm
