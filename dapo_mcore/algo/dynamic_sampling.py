"""Dynamic sampling: keep only groups with mixed outcomes, generating more batches until the step is full.

A group is one prompt's G rollouts. Groups where every rollout is right (or every one wrong) have zero
advantage everywhere and carry no gradient signal, so DAPO drops them and generates again. The filter is on
*accuracy*, not reward, so overlong penalties cannot make an all-wrong group look usable. Every rejected or
surplus rollout still cost generation: :class:`SamplingStats` accounts for it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

logger = logging.getLogger(__name__)


def usable_groups(acc: Tensor) -> Tensor:
    """Bool mask ``[num_groups]`` of groups with ``0 < #correct < G`` from ``acc [num_groups, G]``."""
    if acc.dim() != 2:
        raise ValueError(f"acc must be [num_groups, G], got shape {tuple(acc.shape)}")
    correct = acc.bool().sum(dim=1)
    return (correct > 0) & (correct < acc.shape[1])


@dataclass
class Group:
    """One prompt's rollouts, as the sampler sees them; ``payload`` is whatever the trainer keeps."""

    acc: Sequence[bool] | Tensor
    """Per-rollout correctness (length G)."""

    payload: Any = None
    """Trainer data for the group (prompt, token ids, rewards, ...); never inspected here."""

    response_lengths: Sequence[int] | Tensor | None = None
    """Per-rollout generated token counts, for token accounting; None if unknown."""

    def num_correct(self) -> int:
        """Number of correct rollouts."""
        return sum(1 for a in self.acc if bool(a))

    def is_usable(self) -> bool:
        """Mixed outcomes: at least one right and one wrong rollout."""
        return 0 < self.num_correct() < len(self.acc)

    def num_tokens(self) -> int:
        """Generated tokens of the group (0 when lengths are unknown)."""
        if self.response_lengths is None:
            return 0
        return int(sum(int(n) for n in self.response_lengths))


@dataclass
class SamplingStats:
    """What one step of dynamic sampling generated, kept and threw away."""

    gen_batches: int = 0
    """Generation batches produced."""
    groups_generated: int = 0
    """Groups produced over all batches."""
    groups_kept: int = 0
    """Groups handed to training."""
    groups_rejected: int = 0
    """Groups dropped by the filter (all right or all wrong)."""
    groups_all_correct: int = 0
    """Rejected groups where every rollout was right."""
    groups_all_wrong: int = 0
    """Rejected groups where every rollout was wrong."""
    groups_surplus: int = 0
    """Usable groups dropped because the step was already full."""
    rollouts_generated: int = 0
    """Responses produced."""
    rollouts_kept: int = 0
    """Responses in kept groups."""
    rollouts_rejected: int = 0
    """Responses in filtered-out groups."""
    rollouts_surplus: int = 0
    """Responses in surplus groups."""
    tokens_generated: int = 0
    """Generated tokens (groups that report response lengths)."""
    tokens_kept: int = 0
    """Generated tokens in kept groups."""
    tokens_rejected: int = 0
    """Generated tokens in filtered-out and surplus groups (wasted generation)."""
    _usable_seen: int = field(default=0, repr=False)

    @property
    def usable_fraction(self) -> float:
        """Fraction of generated groups that passed the filter (kept or surplus)."""
        return self._usable_seen / self.groups_generated if self.groups_generated else 0.0

    def _count(self, group: Group, outcome: str) -> None:
        n, tok = len(group.acc), group.num_tokens()
        self.groups_generated += 1
        self.rollouts_generated += n
        self.tokens_generated += tok
        if outcome == "kept":
            self.groups_kept += 1
            self.rollouts_kept += n
            self.tokens_kept += tok
        elif outcome == "surplus":
            self.groups_surplus += 1
            self.rollouts_surplus += n
            self.tokens_rejected += tok
        else:
            self.groups_rejected += 1
            self.rollouts_rejected += n
            self.tokens_rejected += tok
            if group.num_correct() == 0:
                self.groups_all_wrong += 1
            else:
                self.groups_all_correct += 1
        if outcome != "rejected":
            self._usable_seen += 1

    def as_metrics(self, prefix: str = "sampling/") -> dict[str, float]:
        """Flat dict for the metrics logger."""
        out = {prefix + f.name: float(getattr(self, f.name))
               for f in dataclasses.fields(self) if not f.name.startswith("_")}
        out[prefix + "usable_fraction"] = self.usable_fraction
        return out


class DynamicSamplingExhausted(RuntimeError):
    """Raised when max_gen_batches batches did not yield enough usable groups; ``.stats`` tells how far it got."""

    def __init__(self, message: str, stats: SamplingStats) -> None:
        super().__init__(message)
        self.stats = stats


def _exhausted(stats: SamplingStats, target: int, max_gen_batches: int) -> DynamicSamplingExhausted:
    return DynamicSamplingExhausted(
        f"dynamic sampling kept {stats.groups_kept}/{target} usable groups after {stats.gen_batches} generation "
        f"batches (algo.max_gen_batches={max_gen_batches}); {stats.groups_rejected} of "
        f"{stats.groups_generated} groups had no mixed outcome ({stats.groups_all_correct} all right, "
        f"{stats.groups_all_wrong} all wrong). Fix: generate more prompts per batch, raise algo.max_gen_batches "
        "(0 = no limit), or use data of matching difficulty (easier if all wrong, harder if all right).",
        stats,
    )


def collect_groups(
    generate_batch: Callable[[int], Sequence[Group]],
    target_groups: int,
    max_gen_batches: int,
    enabled: bool = True,
) -> tuple[list[Group], SamplingStats]:
    """Gather ``target_groups`` groups for one training step.

    Args:
        generate_batch: called with the 0-based generation batch index of this step; returns its groups.
        target_groups: groups wanted for the step (train batch prompts).
        max_gen_batches: with dynamic sampling, most batches to generate (0 = no limit).
        enabled: False (GRPO baseline) takes one batch unfiltered, truncated to ``target_groups``.

    Returns:
        ``(kept, stats)``: kept groups in generation order (exactly ``target_groups`` when enabled), and stats.

    Raises:
        DynamicSamplingExhausted: ``max_gen_batches`` batches did not hold enough usable groups.
    """
    if target_groups <= 0:
        raise ValueError(f"target_groups={target_groups} must be > 0")
    stats = SamplingStats()
    kept: list[Group] = []
    while len(kept) < target_groups:
        if enabled and max_gen_batches and stats.gen_batches >= max_gen_batches:
            raise _exhausted(stats, target_groups, max_gen_batches)
        batch = list(generate_batch(stats.gen_batches))
        stats.gen_batches += 1
        if not batch:
            raise ValueError(f"generate_batch({stats.gen_batches - 1}) returned no groups; the prompt source is empty")
        for group in batch:
            if enabled and not group.is_usable():
                stats._count(group, "rejected")
            elif len(kept) < target_groups:
                kept.append(group)
                stats._count(group, "kept")
            else:
                stats._count(group, "surplus")
        if not enabled:
            break
    logger.debug("dynamic sampling: %s", stats)
    return kept, stats
