"""Colocated: the replica heads of one host sample on all of its servers (4 server doubles, 4 heads),
each head first on the server of its own GPU, as the placement orders them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from sglang_testing import DOUBLES_TIMEOUT_S, make_engine, needs_sglang_source

from megatron_rl.cluster.placement import plan_placement
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.sglang_engine import SGLangEngine

pytestmark = [needs_sglang_source, pytest.mark.timeout(DOUBLES_TIMEOUT_S)]


def test_four_heads_on_one_host_keep_four_servers_busy(qwen2_dir):
    owner = make_engine(qwen2_dir, num_servers=4)
    try:
        plan = plan_placement([owner.cfg.host], 4, layout="colocated", base_port=owner.cfg.base_port)
        assert [plan.rollout_role(r) for r in range(4)] == ["owner", "client", "client", "client"]
        clients = [SGLangEngine(replace(owner.cfg, server_urls=plan.servers_for(r)), qwen2_dir) for r in (1, 2, 3)]
        # One request per head (a DP shard that fits one request), all at once, as the loop runs them.
        sampling = SamplingParams(temperature=1.0, max_new_tokens=2, n=2, ignore_eos=True)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda e: e.generate([[3, 17, 42]], sampling), [owner, *clients]))
        served = [s.client.get("/_double/log").count("/generate") for s in owner.servers]
        assert served == [1, 1, 1, 1]  # before: [4, 0, 0, 0], three GPUs idle
    finally:
        owner.shutdown()
