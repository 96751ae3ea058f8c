"""Child of test_checkpoint_kill.py: the real loop, SIGKILLed at one point of one checkpoint save.

    python _kill_mid_save.py WHERE STEP CONFIG OVERRIDES_JSON

WHERE: before_folder_rename (every rank wrote step_<STEP>.tmp, not yet renamed) or
before_latest_rename (step_<STEP> in place, `latest` not yet moved).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def _install(where: str, kill_step: int) -> None:
    from megatron_rl.loop import checkpoint

    real_publish, real_replace = checkpoint.Checkpointer._publish, os.replace

    def publish(self, rank, step):
        if where == "before_folder_rename" and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_publish(self, rank, step)

    def replace(src, dst):
        if where == "before_latest_rename" and Path(dst).name == "latest" and Path(src).read_text() == str(kill_step):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)

    checkpoint.Checkpointer._publish = publish
    checkpoint.os = type(os)("os_with_hook")  # the checkpointer's own `os`, nothing else's
    checkpoint.os.__dict__.update(os.__dict__, replace=replace)


def main(argv: list[str]) -> None:
    import torch

    from megatron_rl.config import load_config
    from megatron_rl.train import run

    where, kill_step, config, overrides = argv[0], int(argv[1]), argv[2], json.loads(argv[3])
    torch.multiprocessing.set_start_method("spawn", force=True)  # as megatron_rl.train's __main__
    _install(where, kill_step)
    run(load_config(config, overrides))


if __name__ == "__main__":
    main(sys.argv[1:])
