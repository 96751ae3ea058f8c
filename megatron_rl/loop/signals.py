"""Stop requests and SIGTERM, handled alike under every entry point (`megatron-rl train`,
`python -m megatron_rl.train`, torchrun): train.run installs them, so no launcher can miss them.

- A stop request: SIGUSR1 to the rank, or the file MEGATRON_RL_STOP_REQUEST existing (what
  slurm/job.sh creates on the job's warning signal). The loop stops after the current step with a
  checkpoint (train._stop_after).
- SIGTERM (torchrun or srun stopping the job): stop this rank's SGLang servers and reward worker,
  then exit 143. A Python handler would not run while the main thread waits inside a gloo / NCCL
  collective (a peer died: up to the collective's timeout), so the signal's C-level handler writes
  to a wakeup pipe (signal.set_wakeup_fd) that a watcher thread reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Callable, Iterator

log = logging.getLogger("megatron_rl.loop.signals")

_STOP = threading.Event()  # SIGUSR1 arrived
_ON_SIGTERM: list[Callable[[], None]] = []  # what a SIGTERM stops before the process exits


def stop_requested() -> bool:
    """SIGUSR1 arrived since handle_signals() began, or the stop-request file exists."""
    request = os.environ.get("MEGATRON_RL_STOP_REQUEST")
    return _STOP.is_set() or bool(request and os.path.exists(request))


def on_sigterm(*stops: Callable[[], None]) -> None:
    """Call `stops` (each guarded) when a SIGTERM ends the process inside handle_signals()."""
    _ON_SIGTERM.extend(stops)


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """SIGUSR1 and SIGTERM handled as the module says, the previous handlers restored after (a
    process may run several trainings: tests). Off the main thread Python cannot install handlers:
    then nothing is installed and only the stop file is honoured."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watcher acts
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: _STOP.set())
    threading.Thread(target=_watch, args=(read_fd,), name="sigterm", daemon=True).start()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGUSR1, previous_usr1)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        _ON_SIGTERM.clear()


def _watch(read_fd: int) -> None:
    while True:
        byte = os.read(read_fd, 1)
        if not byte:  # handle_signals() ended
            os.close(read_fd)
            return
        if byte == bytes([signal.SIGTERM]):  # another handled signal (SIGINT, SIGUSR1): not ours
            break
    for stop in list(_ON_SIGTERM):
        try:
            stop()
        except Exception:  # noqa: BLE001 - the rank is exiting; stop the others regardless
            log.exception("while stopping on SIGTERM")
    os._exit(128 + signal.SIGTERM)
