"""SGLangEngine.shutdown() racing a restart: a server found dead after shutdown stays stopped.

The race is real: the SIGTERM watcher (loop/signals.py) calls shutdown() on its own thread while the main
thread may be retrying a request whose server the shutdown just stopped.
"""

from __future__ import annotations

import pytest

from sglang_testing import DOUBLES_TIMEOUT_S, make_engine, needs_sglang_source

pytestmark = [needs_sglang_source, pytest.mark.timeout(DOUBLES_TIMEOUT_S)]


def test_a_server_found_dead_after_shutdown_is_not_restarted(qwen2_dir):
    engine = make_engine(qwen2_dir, num_servers=1)
    server = engine.servers[0]
    try:
        engine.shutdown()
        assert not server.process.alive()
        engine._check_server(server)  # what a failed request does next
        assert not server.process.alive() and engine.stats["restarts"] == 0
    finally:
        engine.shutdown()


def test_a_server_that_exits_at_startup_is_named_with_the_end_of_its_log(tmp_path):
    import sys

    from megatron_rl.rollout.sglang_client import SGLangClient
    from megatron_rl.rollout.sglang_server import ManagedProcess, Server, wait_healthy

    log = tmp_path / "server.log"
    crash = "import sys; print('\\n'.join(f'line {i}' for i in range(30))); print('OSError: [Errno 98] address in use'); sys.exit(3)"
    proc = ManagedProcess([sys.executable, "-c", crash], {}, log)
    proc.start()
    server = Server(SGLangClient("http://127.0.0.1:9", "k", 5.0), 1, proc)
    with pytest.raises(RuntimeError) as err:
        wait_healthy([server], timeout_s=60.0, poll_s=0.05)
    message = str(err.value)
    assert "http://127.0.0.1:9 exited during startup (exit code 3)" in message and str(log) in message
    assert message.endswith("OSError: [Errno 98] address in use")  # the last 20 lines, in order
    assert "line 11" in message and "line 10\n" not in message


def test_a_server_stuck_at_startup_is_named_with_the_end_of_its_log(tmp_path):
    """Still loading or stuck: the timeout error shows what the server printed last."""
    import sys
    import time

    from megatron_rl.rollout.sglang_client import SGLangClient
    from megatron_rl.rollout.sglang_server import ManagedProcess, Server, wait_healthy

    log = tmp_path / "server.log"
    stuck = "import time; print('Load weight begin', flush=True); time.sleep(120)"
    proc = ManagedProcess([sys.executable, "-c", stuck], {}, log)
    proc.start()
    try:
        while "Load weight begin" not in log.read_text():
            time.sleep(0.05)
        server = Server(SGLangClient("http://127.0.0.1:9", "k", 5.0), 1, proc)
        with pytest.raises(RuntimeError) as err:
            wait_healthy([server], timeout_s=0.2, poll_s=0.05)
        assert str(err.value) == (f"SGLang server http://127.0.0.1:9 not healthy after 0 s; the end of {log}:\n"
                                  "Load weight begin")
        log.write_text("")
        with pytest.raises(RuntimeError, match=f"not healthy after 0 s; {log} is empty$"):
            wait_healthy([server], timeout_s=0.2, poll_s=0.05)
        server.process = None  # a server we did not launch (server_urls): nothing to show
        with pytest.raises(RuntimeError, match="^SGLang server http://127.0.0.1:9 not healthy after 0 s$"):
            wait_healthy([server], timeout_s=0.2, poll_s=0.05)
    finally:
        proc.proc.kill()
        proc.proc.wait()


@pytest.mark.parametrize("how", ["never_healthy", "first_exits"])
def test_a_failed_start_stops_every_server_it_launched(how, tmp_path, monkeypatch):
    """A server that never answers /health (or one that exits while the other is still starting)
    fails the start; every process the engine launched is stopped, none left holding its GPU."""
    import sys

    from sglang_testing import API_KEY, free_port_block

    from megatron_rl.rollout.sglang_config import SGLangConfig
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    monkeypatch.setenv("MEGATRON_RL_SGLANG_API_KEY", API_KEY)  # not left to an earlier test's make_engine
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    exits = [sys.executable, "-c", "import sys; sys.exit(4)"]
    cfg = SGLangConfig(num_servers=2, base_port=free_port_block(2), startup_timeout_s=1.0)
    argv_fn = (lambda port, gpu: sleep) if how == "never_healthy" else (lambda port, gpu: exits if gpu == 0 else sleep)
    engine = SGLangEngine(cfg, tmp_path, log_dir=tmp_path, argv_fn=argv_fn, start=False)
    with pytest.raises(RuntimeError, match="not healthy after 1 s" if how == "never_healthy" else "exited during startup"):
        engine.start()
    assert [s.process.proc.poll() is not None for s in engine.servers] == [True, True]
