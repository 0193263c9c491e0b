"""What the trainer asks of the rollout side: one interface, whatever the schedule.

The trainer keeps the algorithm (batch -> samples -> old log-probs -> train -> publish weights -> log / eval /
checkpoint). Everything that turns prompts into a step's scored, shaped and filtered batch (engines, engine
groups, scoring, overlong shaping, dynamic sampling, streaming, staged groups, the partial-rollout buffer) sits
behind :class:`RolloutSource`. ``rollout.pipeline.colocated.ColocatedRollouts`` is the synchronous implementation: the
engines share the trainer's devices and generate between training phases.

The interface has no callback into the trainer. The only thing it is handed at call time is ``stop``, a
cancellation check (a pre-emption signal on any rank) that it may poll between generation calls; when it fires,
the source raises :class:`RolloutInterrupted` and the trainer rolls the source back to its snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dapo_mcore.algo.dynamic_sampling import SamplingStats
from dapo_mcore.rollout.protocol import WeightBucket
from dapo_mcore.rollout.scheduling.groups import GroupData

__all__ = ["RolloutInterrupted", "RolloutSource", "StepBatch"]


class RolloutInterrupted(Exception):
    """``stop()`` said yes between two generation calls: the step's batch was abandoned half way."""


@dataclass
class StepBatch:
    """One step's rollouts, as the trainer receives them."""

    kept: list[GroupData]
    """The groups to train on: exactly ``train.prompts_per_step``, in prompt order."""
    generated: list[GroupData]
    """Every group generated for the step (kept, rejected, surplus, staged out), in decision order; ``kept`` is set."""
    stats: SamplingStats
    """Dynamic sampling's counters for the step (usable groups, batches drawn, tokens aborted, ...)."""
    tools: dict[str, float] = field(default_factory=dict)
    """Multi-turn tool use: the step's ``tools/calls``, ``errors``, ``timeouts``, ``sandbox_failures``, ``seconds``
    and ``waited`` (seconds decoding stood waiting for calls) over every engine group (empty without tools)."""
    policy_version: int | None = None
    """Async mode: the policy version (steps trained) that sampled the batch (its responses' ``versions`` say which
    produced each token: continued prefixes are older); None when it is the trainer's own."""


@runtime_checkable
class RolloutSource(Protocol):
    """The rollout side of a run (see module docstring)."""

    colocated: bool
    """True: the engines share the trainer's devices (the trainer offloads around generation); False: they have
    ranks of their own (the async mode, ``rollout.pipeline.async_source``)."""

    @property
    def weights_valid(self) -> bool:
        """False when the engines no longer hold the last published weights (vLLM sleep level 2): publish first."""

    def wake(self) -> None:
        """Colocated engines take their memory back (KV cache) before generating."""

    def sleep(self) -> None:
        """Colocated engines give their memory back to the trainer."""

    def step_batch(self, step: int, stop: Callable[[], bool]) -> StepBatch:
        """The batch for training step ``step + 1`` (``step`` steps are done). Raises RolloutInterrupted when
        ``stop()`` is true between generation calls."""

    def eval_groups(self, records: list[Any], step: int) -> list[GroupData]:
        """Held-out generation after ``step`` steps: one scored group of ``eval.k`` responses per record."""

    def publish(self, weights: Iterable[WeightBucket]) -> None:
        """The trainer's new weights (Hugging Face names, full tensors, in buckets) reach every engine."""

    def snapshot(self) -> Any:
        """What ``rollback`` needs to undo a step abandoned half way (cheap)."""

    def rollback(self, snap: Any) -> None:
        """Undo everything the abandoned step drew or buffered: its prompts come again."""
