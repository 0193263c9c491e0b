"""Seedable prompt sampler: epoch-wise shuffles, batches of N prompt indices, exact resume.

Each epoch's order is a pure function of ``(seed, epoch)``, so the state is just the epoch and the
cursor inside it: ``load_state_dict(state_dict())`` continues with exactly the batches an
uninterrupted run would have drawn. A batch that reaches the end of an epoch continues into the
next epoch's order, so every prompt is drawn once per epoch and no prompt is silently skipped.
"""

from __future__ import annotations

import random
from typing import Any


class PromptSampler:
    """Draws batches of indices into a dataset of ``num_prompts`` prompts."""

    def __init__(self, num_prompts: int, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts={num_prompts}: the prompt set is empty; check the data source")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(f"prompt-sampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` prompt indices (crossing into the next epoch when needed)."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            take = min(self.batch_size - len(batch), self.num_prompts - self.cursor)
            batch.extend(self._order[self.cursor : self.cursor + take])
            self.cursor += take
            if self.cursor == self.num_prompts:
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order(self.epoch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (plain ints and bools, JSON-serialisable)."""
        return {"num_prompts": self.num_prompts, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the dataset, seed and shuffle must match the saved run."""
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this run has "
                                 f"{getattr(self, key)!r}; resume with the same data and data.shuffle_seed")
        if not 0 <= state["cursor"] < self.num_prompts or state["epoch"] < 0:
            raise ValueError(f"sampler state epoch={state['epoch']} cursor={state['cursor']} is out of range")
        # A changed batch size is allowed: the stream of indices stays the same, only its chunking changes.
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self._order = self._epoch_order(self.epoch)
