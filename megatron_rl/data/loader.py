"""Deterministic, resumable prompt batches over epochs: the data position of the RL checkpoint."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from megatron_rl.data.datasets import PromptDataset, PromptItem


class PromptLoader:
    """Fixed-size batches of PromptItem (endless, or `num_epochs` passes); epoch e is a permutation seeded by (seed, e).

    A batch that crosses an epoch end takes the rest from the next epoch's order, so every batch has
    exactly `batch_size` items. `state_dict()` after k batches, loaded into a fresh loader over the
    same dataset, yields exactly the batches k+1, k+2, ... of the uninterrupted run.

        loader = PromptLoader(dataset, batch_size=8, seed=1)
        for step in range(num_steps):
            items = loader.next_batch()
    """

    def __init__(self, dataset: "PromptDataset", batch_size: int, seed: int, shuffle: bool = True,
                 num_epochs: int = 0):
        if num_epochs < 0:
            raise ValueError(f"num_epochs must be >= 0, got {num_epochs}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise ValueError("PromptLoader needs a non-empty dataset")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs  # 0: endless
        self.batches_served = 0
        self.epoch = 0
        self.position = 0  # index into the current epoch's order
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by random.Random: stable across runs and platforms.
            random.Random(f"prompt-loader:{self.seed}:{epoch}").shuffle(order)
        return order

    @property
    def num_batches(self) -> int | None:
        """Full batches in `num_epochs` passes (the last partial one is dropped); None when endless."""
        return None if not self.num_epochs else self.num_epochs * len(self.dataset) // self.batch_size

    def next_batch(self) -> list["PromptItem"]:
        """The next `batch_size` items (in the epoch's order, wrapping into the next epoch).

        StopIteration once `num_batches` batches were served (num_epochs > 0)."""
        if self.num_batches is not None and self.batches_served >= self.num_batches:
            raise StopIteration(f"{self.num_epochs} epochs of {len(self.dataset)} prompts served")
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self.position)
            batch.extend(self.dataset[i] for i in self._order[self.position : self.position + take])
            self.position += take
        self.batches_served += 1
        return batch

    def __iter__(self) -> Iterator[list["PromptItem"]]:
        while self.num_batches is None or self.batches_served < self.num_batches:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and a bool: safe for JSON and `torch.load(weights_only=True)`."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_items": len(self.dataset),
            "batches_served": self.batches_served,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position. ValueError if the dataset size differs (the order would too)."""
        if state["num_items"] != len(self.dataset):
            raise ValueError(
                f"loader state num_items={state['num_items']} != dataset size {len(self.dataset)}: "
                "the dataset changed since the checkpoint"
            )
        if not 0 <= state["position"] <= state["num_items"]:
            raise ValueError(f"loader state position={state['position']} out of range")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        # Older checkpoints lack the count: recover it from the position (exact for whole batches).
        served = state.get("batches_served", (self.epoch * len(self.dataset) + self.position) // self.batch_size)
        self.batches_served = int(served)
        self._order = self._epoch_order(self.epoch)
