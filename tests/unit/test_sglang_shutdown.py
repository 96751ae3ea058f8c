"""SGLangEngine.shutdown() racing a restart: a server found dead after shutdown stays stopped.

The race is real: train.py's SIGTERM watcher calls shutdown() on its own thread while the main
thread may be retrying a request whose server the shutdown just stopped.
"""

from __future__ import annotations

import pytest

from sglang_testing import make_engine, needs_sglang_source

pytestmark = [needs_sglang_source, pytest.mark.timeout(120)]


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
