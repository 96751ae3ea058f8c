"""SGLangEngine speaks SGLang 0.5.23's update protocol: version check, server settings, flush retry,
FP8 KV with unit scales, the whole rollout.sglang section on every launched server and router."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from sglang_testing import API_KEY, DOUBLES_TIMEOUT_S, start_double

from megatron_rl.rollout.sglang_client import SGLangHTTPError
from megatron_rl.rollout.sglang_config import SGLangConfig

pytestmark = pytest.mark.timeout(DOUBLES_TIMEOUT_S)


@pytest.fixture(scope="module")
def fp8_kv_server(qwen2_dir):
    proc, url = start_double(qwen2_dir, "--kv-cache-dtype", "fp8_e4m3", "--health-generate-s", "1.5")
    yield url
    proc.kill()
    proc.wait()


def attach(url, **kw):
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    return SGLangEngine(SGLangConfig(server_urls=[url], request_timeout_s=60, **kw), "unused")


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", API_KEY)


def test_untested_sglang_version_is_refused_by_name(fp8_kv_server, monkeypatch):
    from megatron_rl.rollout import sglang_engine

    # The double reports 0.5.23; an engine tested only against 0.5.30 must refuse it by name.
    monkeypatch.setattr(sglang_engine, "SUPPORTED_VERSIONS", ("0.5.30",))
    with pytest.raises(RuntimeError, match=r"SGLang 0.5.23 at http://127.0.0.1:\d+ is not supported.*0.5.30"):
        attach(fp8_kv_server, kv_cache_dtype="fp8_e4m3")


def test_server_started_with_other_settings_is_refused(fp8_kv_server):
    with pytest.raises(RuntimeError, match="kv_cache_dtype='fp8_e4m3' but rollout.sglang.kv_cache_dtype='auto'"):
        attach(fp8_kv_server)


def test_fp8_kv_cache_syncs_with_unit_scales_when_asked(fp8_kv_server, qwen2_dir, caplog):
    from safetensors.torch import load_file

    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.sync.sglang_transport import SGLangTensorTransport

    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.sglang"):
        attach(fp8_kv_server, kv_cache_dtype="fp8_e4m3")  # calibrated scales, the default: no warning
        engine = attach(fp8_kv_server, kv_cache_dtype="fp8_e4m3", kv_scales="unit")
    assert caplog.messages == ["FP8 KV cache (fp8_e4m3) with SGLang's unit k/v scales (1.0), as slime and miles "
                               "run it; set rollout.sglang.kv_scales=sent to send recalibrated scales"]
    transport = SGLangTensorTransport(engine)
    transport.begin(1)
    transport.send(sorted(load_file(str(qwen2_dir / "model.safetensors")).items()), 1)
    transport.finish(1)  # no k_scale / v_scale sent: SGLang keeps 1.0, as slime and miles run it
    assert engine.weight_version == 1
    sample = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0]
    assert len(sample.response_ids) == 2


def test_flush_is_retried_while_a_health_probe_holds_the_server(fp8_kv_server):
    engine = attach(fp8_kv_server, kv_cache_dtype="fp8_e4m3")
    client = engine.servers[0].client
    probe = threading.Thread(target=client.healthy, args=("/health_generate", 10.0))
    probe.start()
    time.sleep(0.3)
    engine.flush_cache(retry_s=0.5)  # refused (400) at first; passes once the probe is done
    probe.join()
    probe = threading.Thread(target=client.healthy, args=("/health_generate", 10.0))
    probe.start()
    time.sleep(0.3)
    engine.cfg.flush_retries = 1
    with pytest.raises(SGLangHTTPError, match="Flush cache failed"):
        engine.flush_cache()
    probe.join()


def test_disaggregated_servers_get_the_whole_sglang_section():
    from megatron_rl.config import RunConfig
    from megatron_rl.cluster.launch import serve_argvs
    from megatron_rl.cluster.placement import placement_for_config

    cfg = RunConfig()
    cfg.rollout.engine = "sglang"
    cfg.rollout.sglang = SGLangConfig(
        mode="disaggregated", tp_size=2, weight_transport="nccl", kv_cache_dtype="fp8_e4m3",
        mem_fraction_static=0.55, quantization="fp8", extra_args=["--context-length", "20480"],
        server_command=["/opt/sgl/bin/python", "-m", "sglang.launch_server"],
        router_command=["/opt/sgl/bin/sglang-router"], request_timeout_s=7200)
    plan = placement_for_config(cfg, ["r0", "t0"], 2, rollout_nodes=1)
    server, router = serve_argvs(plan, "r0", cfg, "/ckpt", "KEY")
    assert server[:3] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"]
    pairs = dict(zip(server[3::2], server[4::2]))
    assert pairs["--kv-cache-dtype"] == "fp8_e4m3" and pairs["--mem-fraction-static"] == "0.55"
    assert pairs["--quantization"] == "fp8" and pairs["--tp-size"] == "2" and pairs["--host"] == "r0"
    assert server[server.index("--context-length") + 1] == "20480"
    assert router[0] == "/opt/sgl/bin/sglang-router"
    assert router[router.index("--api-key") + 1] == "KEY"
    assert float(router[router.index("--request-timeout-secs") + 1]) >= 7200


def test_declared_sglang_pin_is_the_tested_version():
    import re
    from pathlib import Path

    from megatron_rl.rollout.sglang_engine import SUPPORTED_VERSIONS

    root = Path(__file__).resolve().parents[2]
    setup_pins = re.findall(r'"sglang([=<>!~]=?[^"]*)"', (root / "setup.py").read_text())
    make_pins = re.findall(r'"sglang([=<>!~]=?[^"]*)"', (root / "Makefile").read_text())
    assert setup_pins == [f"=={v}" for v in SUPPORTED_VERSIONS] and make_pins == setup_pins


def test_deterministic_inference_flag_reaches_the_server():
    from megatron_rl.rollout.sglang_server import server_args

    assert "--enable-deterministic-inference" not in server_args(SGLangConfig(), "/m", 1, 0, 0)
    assert "--enable-deterministic-inference" in server_args(SGLangConfig(deterministic_inference=True), "/m", 1, 0, 0)


def test_a_session_a_failed_sync_left_open_is_closed_and_opened_again(fp8_kv_server, caplog):
    """A sync that died between begin and end leaves the server's update session open, and SGLang
    refuses the next begin_weight_update ("already open", weight_updater.py:309-334). The next sync
    closes that session, with a warning naming the server, and opens its own."""
    from megatron_rl.rollout.sglang_client import SGLangClient

    client = SGLangClient(fp8_kv_server, API_KEY)
    client.post("/begin_weight_update", {})  # the session a failed sync left open
    engine = attach(fp8_kv_server, kv_cache_dtype="fp8_e4m3", kv_scales="unit")
    before = len(client.get("/_double/log"))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.sglang"):
        engine.begin_update(1)
    assert f"{fp8_kv_server}: closing a weight-update session left open by a failed sync" in caplog.messages
    engine.finish_update(1)
    sessions = [p for p in client.get("/_double/log")[before:] if p.endswith("_weight_update")]
    assert sessions == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update", "/end_weight_update"]
    with pytest.raises(SGLangHTTPError, match="no weight-update session is open"):
        client.post("/end_weight_update", {})  # the update closed its session: none is left open


@pytest.mark.parametrize("mode, retried", [("in_place", 0), ("abort", 1)])
def test_pause_in_place_lets_a_request_in_flight_finish_and_abort_ends_it(fp8_kv_server, mode, retried):
    """rollout.sglang.pause_mode reaches /pause_generation: "in_place" keeps a request in flight
    running, "abort" ends it with finish_reason abort, which the engine retries once resumed."""
    from megatron_rl.rollout.base import SamplingParams

    engine = attach(fp8_kv_server, kv_cache_dtype="fp8_e4m3", pause_mode=mode, max_retries=1)
    client = engine.servers[0].client
    before = len(client.get("/_double/log"))
    samples = []
    sampling = SamplingParams(max_new_tokens=400, ignore_eos=True)
    rollout = threading.Thread(target=lambda: samples.extend(engine.generate([[1, 2, 3]], sampling)))
    rollout.start()
    while "/generate" not in client.get("/_double/log")[before:]:
        time.sleep(0.01)
    engine.pause()
    engine.resume()
    rollout.join()
    assert [len(s.response_ids) for s in samples] == [400]
    assert engine.stats["retries"] == retried
