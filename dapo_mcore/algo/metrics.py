"""Per-step statistics of a rollout batch: lengths, truncation, rewards, accuracy, advantages, usable groups.

Inputs are flat per-response tensors (or ``[B, T]`` for advantages with a mask); outputs are plain floats
ready for the metrics logger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from dapo_mcore.algo.dynamic_sampling import usable_groups


def response_length_stats(lengths: Tensor, truncated: Tensor, prefix: str = "response_length/") -> dict[str, float]:
    """Mean/max/min response length and the truncated fraction (``truncated`` is a ``[B]`` bool tensor)."""
    if lengths.numel() == 0:
        raise ValueError("response_length_stats needs at least one response")
    lengths = lengths.to(torch.float64)
    return {
        prefix + "mean": lengths.mean().item(),
        prefix + "max": lengths.max().item(),
        prefix + "min": lengths.min().item(),
        prefix + "truncated_frac": truncated.to(torch.float64).mean().item(),
    }


def reward_stats(rewards: Tensor, acc: Tensor, prefix: str = "reward/") -> dict[str, float]:
    """Mean/max/min of the (shaped) reward and mean accuracy over responses."""
    if rewards.numel() == 0:
        raise ValueError("reward_stats needs at least one response")
    rewards = rewards.to(torch.float64)
    return {
        prefix + "mean": rewards.mean().item(),
        prefix + "max": rewards.max().item(),
        prefix + "min": rewards.min().item(),
        prefix + "acc": acc.to(torch.float64).mean().item(),
    }


def advantage_stats(advantages: Tensor, mask: Tensor | None = None, prefix: str = "advantage/") -> dict[str, float]:
    """Mean/max/min/abs-mean of advantages over responses ``[B]`` or masked tokens ``[B, T]``."""
    values = advantages.to(torch.float64)
    if mask is not None:
        values = values[mask.bool()]
    if values.numel() == 0:
        return {prefix + k: 0.0 for k in ("mean", "max", "min", "abs_mean")}
    return {
        prefix + "mean": values.mean().item(),
        prefix + "max": values.max().item(),
        prefix + "min": values.min().item(),
        prefix + "abs_mean": values.abs().mean().item(),
    }


def usable_group_fraction(acc: Tensor) -> float:
    """Fraction of groups ``acc [num_groups, G]`` with mixed outcomes (0 < #correct < G)."""
    if acc.shape[0] == 0:
        return 0.0
    return usable_groups(acc).to(torch.float64).mean().item()


CORRECTION_PREFIX = "rollout_corr/"
SKIPPED = "skipped"
"""Key an update reports (alone) when it was skipped: its mini-batch had no trainable token."""


def average_updates(per_update: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """A step's metrics from its mini-batch updates: each key averaged over the updates that report it.

    A skipped update (``{"skipped": 1.0}``: every token of its mini-batch masked, e.g. all responses truncated
    under the overlong filter) trained nothing, so it must not count as a zero loss, clip fraction or entropy:
    it is left out of every average and counted in ``skipped_updates``; ``updates`` counts the others. A step
    whose updates were all skipped reports only the two counts.
    """
    done = [u for u in per_update if not u.get(SKIPPED)]
    out: dict[str, float] = {}
    for key in sorted({k for u in done for k in u}):
        values = [u[key] for u in done if key in u]
        out[key] = sum(values) / len(values)
    # Bypass mode's correction metrics describe the data, also of an update skipped because all of it was rejected.
    for key in sorted({k for u in per_update for k in u if k.startswith(CORRECTION_PREFIX)}):
        values = [u[key] for u in per_update if key in u]
        out[key] = sum(values) / len(values)
    out["updates"] = float(len(done))
    out["skipped_updates"] = float(len(per_update) - len(done))
    return out
