"""Planted outliers at TP=2 and PP=2 over 2 gloo processes: the same weights and function as at TP=PP=1."""

from __future__ import annotations

import pytest
import torch
from _launch import run_distributed

LAYOUTS = [("tp2", 2, 1), ("pp2", 1, 2)]
K, SCALE, SEED = 4, 30.0, 7


def make_batch() -> dict:
    tokens = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(3))
    return {"tokens": tokens, "loss_mask": torch.ones(4, 12)}


def planted(parallel, hf_dir) -> dict:
    """Log-probs before / after planting and the exported (full, HF-named) planted weights."""
    from megatron_rl.actor.actor import MegatronActor

    actor = MegatronActor.build(hf_dir, parallel=parallel)
    before = actor.compute_logprobs(make_batch(), micro_batch_size=2, with_entropy=False)["logprobs"]
    channels = actor.plant_outliers(K, SCALE, seed=SEED)
    after = actor.compute_logprobs(make_batch(), micro_batch_size=2, with_entropy=False)["logprobs"]
    return {"before": before, "after": after, "channels": channels, "exported": dict(actor.export_hf_weights())}


def worker(rank: int, world_size: int, hf_dir: str) -> dict:
    from megatron_rl.actor.parallel import init_parallel

    return {name: planted(init_parallel(tp, pp, seed=0), hf_dir) for name, tp, pp in LAYOUTS}


@pytest.fixture(scope="module")
def runs(qwen2_dir, single_parallel) -> tuple[dict, list[dict]]:
    reference = planted(single_parallel, qwen2_dir)
    return reference, run_distributed(worker, world_size=2, args=(str(qwen2_dir),), timeout_s=180)


@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS])
def test_planting_is_layout_independent(runs, name):
    reference, results = runs
    exported = {}
    for rank_result in results:  # PP: each stage exports its own layers; TP: both ranks export everything
        exported.update(rank_result[name]["exported"])
        assert rank_result[name]["channels"] == reference["channels"]
    assert exported.keys() == reference["exported"].keys()
    for key, tensor in reference["exported"].items():
        assert torch.equal(exported[key], tensor), key
    last = results[-1][name]  # the last PP stage (every rank at TP=2) holds the log-probs
    torch.testing.assert_close(last["after"], last["before"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last["after"], reference["after"], rtol=1e-5, atol=1e-5)
