"""Run at the start of every Python process of the test server (this folder is first on its PYTHONPATH).

sglang 0.5.23's /release_memory_occupation ends with `torch.get_device_module().synchronize()`
(srt/managers/scheduler_components/weight_updater.py:379, ReleaseMemoryOccupationReqInput). The
torch 2.14.1 that sglang pins is PyPI's CUDA build, whose current device module is `torch.cuda`
even on a machine without a GPU; its synchronize() initializes CUDA and raises "Found no NVIDIA
driver", which kills the scheduler and with it the server. Without a usable GPU there is no device
work to wait for, so synchronize() becomes a no-op; with a GPU nothing changes.
"""

import torch

if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda device=None: None
