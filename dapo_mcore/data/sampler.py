"""Seedable prompt sampler: epoch-wise shuffles, batches of N prompts, exact resume.

Each epoch's order is a pure function of ``(seed, epoch)``, so the state is just the epoch and the
cursor inside it: ``load_state_dict(state_dict())`` continues with exactly the prompts an
uninterrupted run would have drawn. The state does not depend on the batch sizes asked for (DAPO's
dynamic sampling draws generation batches until enough usable groups exist). A batch that reaches the
end of an epoch continues into the next epoch's order, so every prompt is drawn once per epoch.

With a :class:`~dapo_mcore.data.prompt_history.PromptHistory`, ``next_selected`` skips prompts the history
says carried no signal lately; the history is part of the state, so a resume takes the same skip decisions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from dapo_mcore.data.prompt_history import PromptHistory

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Draws batches from a fixed sequence of prompts (usually ``PromptRecord``)."""

    def __init__(self, records: Sequence[T], seed: int = 0, shuffle: bool = True,
                 history: PromptHistory | None = None) -> None:
        if len(records) < 1:
            raise ValueError("the prompt set is empty; check data.train")
        self.records = records
        self.num_prompts = len(records)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order(0)
        self.history = history

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(f"prompt-sampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` prompt indices (crossing into the next epoch when needed)."""
        if n < 1:
            raise ValueError(f"batch size {n} must be >= 1")
        batch: list[int] = []
        while len(batch) < n:
            take = min(n - len(batch), self.num_prompts - self.cursor)
            batch.extend(self._order[self.cursor : self.cursor + take])
            self.cursor += take
            if self.cursor == self.num_prompts:
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order(self.epoch)
        return batch

    def next_batch(self, n: int) -> list[T]:
        """The next ``n`` prompts."""
        return [self.records[i] for i in self.next_indices(n)]

    def next_selected(self, n: int) -> tuple[list[int], int]:
        """The next ``n`` prompt indices the history does not skip, and how many were skipped on the way.

        Without a history this is ``next_indices(n)``. At most one epoch's worth of prompts is skipped per call,
        so a call returns fewer than ``n`` indices only if the history skipped that many in a row.
        """
        if self.history is None:
            return self.next_indices(n), 0
        chosen: list[int] = []
        skipped = 0
        while len(chosen) < n and skipped < self.num_prompts:
            index = self.next_indices(1)[0]
            if self.history.should_skip(index):
                skipped += 1
            else:
                chosen.append(index)
        return chosen, skipped

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (plain ints and bools, JSON-serialisable)."""
        state: dict[str, Any] = {"num_prompts": self.num_prompts, "seed": self.seed, "shuffle": self.shuffle,
                                 "epoch": self.epoch, "cursor": self.cursor}
        if self.history is not None:
            state["history"] = self.history.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the prompt set, seed and shuffle must match the saved run."""
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this run has "
                                 f"{getattr(self, key)!r}; resume with the same data and seed")
        if not 0 <= state["cursor"] < self.num_prompts or state["epoch"] < 0:
            raise ValueError(f"sampler state epoch={state['epoch']} cursor={state['cursor']} is out of range")
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self._order = self._epoch_order(self.epoch)
        if self.history is not None and "history" in state:
            # A checkpoint of a run without prompt history starts the history empty.
            self.history.load_state_dict(state["history"])
