"""loop/signals.py: SIGUSR1 and the stop file request a stop, SIGTERM runs the registered stops and
exits 143 (a real child process), and the previous handlers come back when a training ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from megatron_rl.loop import signals


def _watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sigterm"]


def test_sigusr1_requests_a_stop_and_the_handlers_are_restored_after(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGATRON_RL_STOP_REQUEST", raising=False)
    before = (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM))
    with signals.handle_signals():
        assert not signals.stop_requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # the Python handler runs between bytecodes of the main thread
        assert signals.stop_requested()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
    deadline = time.monotonic() + 5
    while _watchers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _watchers()  # the watcher read end-of-file and ended
    with signals.handle_signals():
        assert not signals.stop_requested()  # a new training starts without the old request
        request = tmp_path / "stop-requested"
        monkeypatch.setenv("MEGATRON_RL_STOP_REQUEST", str(request))
        assert not signals.stop_requested()
        request.touch()
        assert signals.stop_requested()


CHILD = textwrap.dedent("""
    import pathlib, sys, time
    from megatron_rl.loop import signals
    out = pathlib.Path(sys.argv[1])
    def boom():
        raise RuntimeError("a failing stop must not keep the next from running")
    with signals.handle_signals():
        signals.on_sigterm(boom, lambda: out.write_text("servers stopped"))
        print("ready", flush=True)
        time.sleep(60)
""")


def test_sigterm_runs_the_registered_stops_and_exits_143(tmp_path):
    out = tmp_path / "stopped"
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.read_text() == "servers stopped"
    assert "a failing stop must not keep the next from running" in proc.stderr.read()
