"""The whole DAPO step of the simulator (``benchmarks/rollout_sim.py``): phases composed into a step time.

Pure arithmetic on seconds, so each rule can be checked by hand:

* **Synchronous, colocated** (today's loop, and sync + streaming over all engines): every GPU generates, then
  computes the old log-probs, then trains, then the weights go into the engines: the step is the sum of the phases.
* **Asynchronous, disaggregated, one policy version behind**: while the trainer GPUs compute batch k's old
  log-probs and updates, the engine GPUs generate batch k+1 with the weights they hold; then the weights move
  trainer -> engines, and both sides take part in that copy (counted as fully exposed). Period k is
  ``max(generation of batch k+1, trainer on batch k) + transfer``; the side that finishes first waits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phases:
    """Seconds of one step's phases (on whichever GPUs run them)."""

    generation: float
    old_logprobs: float
    train: float
    weight_sync: float

    @property
    def trainer(self) -> float:
        """The trainer's work on one batch."""
        return self.old_logprobs + self.train


@dataclass(frozen=True)
class StepTime:
    """One step's wall time and who waited for whom during it."""

    phases: Phases
    step: float
    trainer_wait: float
    """Seconds the trainer GPUs waited for rollouts (asynchronous only)."""
    engine_wait: float
    """Seconds the engine GPUs waited for new weights (asynchronous only)."""


def sync_step(phases: Phases) -> StepTime:
    """Colocated synchronous step: the phases one after the other on the same GPUs."""
    step = phases.generation + phases.old_logprobs + phases.train + phases.weight_sync
    return StepTime(phases, step, 0.0, 0.0)


def async_step(generation_next: float, trainer: Phases, transfer: float) -> StepTime:
    """One asynchronous period: batch k+1 generated (``generation_next`` s) while the trainer works on batch k."""
    work = trainer.trainer
    phases = Phases(generation_next, trainer.old_logprobs, trainer.train, transfer)
    return StepTime(phases, max(generation_next, work) + transfer, max(0.0, generation_next - work),
                    max(0.0, work - generation_next))


def async_steps(generation: list[float], trainer: list[Phases], transfer: float) -> list[StepTime]:
    """Periods of a run of steps of one stage: batch k's training beside batch k+1's generation (cyclically, so
    every simulated batch is used once on each side)."""
    if len(generation) != len(trainer) or not generation:
        raise ValueError("need one generation time and one trainer time per simulated step")
    n = len(generation)
    return [async_step(generation[(k + 1) % n], trainer[k], transfer) for k in range(n)]


def mean_step(steps: list[StepTime]) -> StepTime:
    """The mean of each field over ``steps``."""
    n = len(steps)

    def avg(get) -> float:
        return sum(get(s) for s in steps) / n

    phases = Phases(avg(lambda s: s.phases.generation), avg(lambda s: s.phases.old_logprobs),
                    avg(lambda s: s.phases.train), avg(lambda s: s.phases.weight_sync))
    return StepTime(phases, avg(lambda s: s.step), avg(lambda s: s.trainer_wait), avg(lambda s: s.engine_wait))
