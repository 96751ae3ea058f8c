"""A server that dies around a weight sync, and a client engine after an owner's sync, against two
launched server doubles, in the colocated memory protocol's order (loop/colocated.py):

    generate -> release(weights, kv_cache, cuda_graph) -> resume(weights) -> sync -> resume(kv_cache, cuda_graph)

A dead server is never restarted inside the sync (the trainer's other ranks wait in the export's
collectives meanwhile): it is left out of the update, and the next generate() restarts it. A
restarted server is released like its peers, so the resume that follows finds what it names
(SGLang's resume removes each tag from its released set and fails on a missing one: KeyError)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_testing import DOUBLES_TIMEOUT_S, make_engine, needs_sglang_source

from megatron_rl.loop.colocated import RELEASE_TAGS, RESUME_AFTER_SYNC
from megatron_rl.rollout.base import SamplingParams

pytestmark = [needs_sglang_source, pytest.mark.timeout(2 * DOUBLES_TIMEOUT_S)]

PROMPTS = [[3, 17, 42, 5], [9, 9, 1]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=2, n=2, ignore_eos=True)


def weights(model_dir: Path, factor: float):
    from safetensors.torch import load_file

    return [(n, t * factor) for n, t in sorted(load_file(str(model_dir / "model.safetensors")).items())]


def sync(transport, named, version: int) -> None:
    from megatron_rl.sync.buckets import iter_buckets

    transport.begin(version)
    for bucket in iter_buckets(named, 16 * 1024):
        transport.send(bucket, version)
    transport.finish(version)


def kill(server) -> None:
    server.process.proc.kill()
    server.process.proc.wait()


def served(engine) -> list[str]:
    return [s.client.get("/model_info")["weight_version"] for s in engine.servers]


@pytest.fixture(scope="module")
def engine(qwen2_dir):
    eng = make_engine(qwen2_dir, num_servers=2, mode="colocated")
    yield eng
    eng.shutdown()


def test_a_server_dead_at_the_sync_is_left_out_and_restarted_by_the_next_generate(engine, qwen2_dir):
    from test_transport_sglang import as_held

    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    transport = SGLangTensorTransport(engine)
    sync(transport, weights(qwen2_dir, 1.0), 1)
    engine.generate(PROMPTS, SAMPLING)
    engine.release_memory(RELEASE_TAGS)
    engine.resume_memory(("weights",))
    dead = engine.servers[1]
    kill(dead)
    sync(transport, weights(qwen2_dir, 2.0), 2)  # server 0 only: no restart inside the sync
    assert engine.stats["restarts"] == 0 and not dead.process.alive()
    assert (dead.down, dead.version, engine.servers[0].version) == (True, -1, 2)
    engine.resume_memory(RESUME_AFTER_SYNC)  # the live server's released tags only
    samples = engine.generate(PROMPTS, SAMPLING)  # restarts server 1 first; it holds the checkpoint
    assert len(samples) == 4 and engine.stats["restarts"] == 1
    assert (dead.down, dead.version, dead.process.alive()) == (False, -1, True)
    assert served(engine) == ["2", "0"]
    # the next step takes it back: released with its peers, resumed, updated, sampled from
    engine.release_memory(RELEASE_TAGS)
    engine.resume_memory(("weights",))
    named = weights(qwen2_dir, 3.0)
    sync(transport, named, 3)
    engine.resume_memory(RESUME_AFTER_SYNC)
    assert served(engine) == ["3", "3"] and [s.version for s in engine.servers] == [3, 3]
    held = dead.client.get("/_double/hf_digests")
    assert {n: held[n] for n, _ in named} == as_held(named)
    assert len(engine.generate(PROMPTS, SAMPLING)) == 4


def test_a_server_restarted_while_released_is_released_like_its_peers(engine, qwen2_dir):
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    engine.release_memory(RELEASE_TAGS)
    dead = engine.servers[0]
    kill(dead)
    engine._check_server(dead)  # what a request's failure does: restart it
    memory_calls = [p for p in dead.client.get("/_double/log") if p.endswith("_memory_occupation")]
    assert dead.process.alive() and memory_calls == ["/release_memory_occupation"]
    engine.resume_memory(("weights",))  # SGLang would raise KeyError on a tag the server never released
    sync(SGLangTensorTransport(engine), weights(qwen2_dir, 4.0), engine.weight_version + 1)
    engine.resume_memory(RESUME_AFTER_SYNC)
    assert len(engine.generate(PROMPTS, SAMPLING)) == 4


def test_a_client_engine_follows_the_owners_version_and_refuses_older_samples(engine, qwen2_dir):
    from megatron_rl.fp8.rollout_quant import RolloutQuantSpec
    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import RolloutUnavailableError, SGLangEngine
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport
    from megatron_rl.sync.weight_sync import WeightSync

    client = SGLangEngine(SGLangConfig(server_urls=[s.url for s in engine.servers], mode="colocated",
                                       max_retries=1, request_timeout_s=60.0), qwen2_dir)
    version = engine.weight_version + 1
    sync(SGLangTensorTransport(engine), weights(qwen2_dir, 5.0), version)  # the owner's update
    actor = SimpleNamespace(export_hf_weights=lambda: iter(()), parallel=SimpleNamespace(pp_size=1, pp_rank=0))
    follower = WeightSync(actor, None, RolloutQuantSpec(), follower=client)
    follower.version = version - 1  # the client rank's count of syncs, in step with the owner's
    follower.sync()
    assert client.weight_version == version
    assert len(client.generate(PROMPTS, SAMPLING)) == 4
    client.follow_version(version + 1)  # as if the owner had moved on and the servers had not
    with pytest.raises(RolloutUnavailableError, match="re-sync the weights"):
        client.generate(PROMPTS, SAMPLING)
