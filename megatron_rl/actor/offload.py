"""Trainer state offload for colocated runs: storages copied to (pinned) host memory and freed.

Whole storages move, not tensors: Megatron's parameters and `main_grad`s are views into
contiguous DDP buffers, and resizing a storage to 0 bytes frees it while every view, the
optimizer's references and the DDP bucket bookkeeping stay valid. `reload` resizes the storage
back and copies the bytes in, so offload -> reload is bitwise and nothing needs re-wiring.
(torch_memory_saver would instead unmap the virtual addresses; it needs the tensors allocated
inside its region at build time, which Megatron's builders do not offer here.)

    offloader = StorageOffloader()
    offloader.offload(tensors_of_some_group)   # device memory freed (CUDA cache emptied)
    ... engine uses the memory ...
    offloader.reload()                          # same bytes, same storages
"""

from __future__ import annotations

from typing import Iterable

import torch


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageOffloader:
    """Holds the host copies of offloaded storages until `reload`."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def offloaded_bytes(self) -> int:
        return sum(host.numel() for _, host in self._held)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy each distinct live storage behind `tensors` to host memory and free it.

        Returns the bytes freed. Storages already offloaded (0 bytes) are skipped.
        """
        seen = {storage.data_ptr() for storage, _ in self._held}
        freed = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            pinned = storage.device.type == "cuda"
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            host.copy_(_bytes_of(storage))
            storage.resize_(0)
            self._held.append((storage, host))
            freed += host.numel()
        if freed and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand the blocks back to the driver for the engine
        return freed

    def reload(self) -> int:
        """Re-allocate every offloaded storage and copy its bytes back; returns the bytes."""
        total = 0
        for storage, host in self._held:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=False)
            total += host.numel()
        self._held = []
        return total
