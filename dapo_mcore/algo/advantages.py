"""Outcome advantages per group of responses to one prompt.

``grpo`` (GRPO/DAPO): ``A_i = (R_i - mean(R_group)) / (std(R_group) + eps)``.
``rloo`` (REINFORCE leave-one-out): ``A_i = R_i - mean of the other G - 1 rewards`` (no std normalization).
"""

from __future__ import annotations

import torch
from torch import Tensor

ESTIMATORS = ("grpo", "rloo")
"""The advantage estimators :func:`group_advantages` knows (``algo.advantage_estimator``)."""


def group_advantages(rewards: Tensor, norm_by_std: bool = True, eps: float = 1e-6, estimator: str = "grpo") -> Tensor:
    """Advantages of ``rewards [num_groups, G]`` (one row per prompt, G responses each), same shape.

    ``grpo``: the std is the unbiased estimator (divisor G - 1), as in verl; a group of size 1 gets mean 0 and std 1,
    so its advantage is ``R / (1 + eps)`` (``R`` without std normalization).
    ``rloo``: ``R_i - (sum(R) - R_i) / (G - 1)``, which is ``G / (G - 1)`` times the group-centred reward; needs
    G >= 2 and ``norm_by_std=False``. Computed in float64 at least.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    dtype = torch.promote_types(rewards.dtype, torch.float64)
    r = rewards.to(dtype)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if estimator == "rloo":
        _check_rloo(r.shape[1], norm_by_std)
        others = (r.sum(dim=1, keepdim=True) - r) / (r.shape[1] - 1)
        return (r - others).to(out_dtype)
    if r.shape[1] == 1:
        mean = torch.zeros_like(r)
        std = torch.ones_like(r)
    else:
        mean = r.mean(dim=1, keepdim=True)
        std = r.std(dim=1, unbiased=True, keepdim=True)
    centred = r - mean
    adv = centred / (std + eps) if norm_by_std else centred
    return adv.to(out_dtype)


def _check_rloo(group_size: int, norm_by_std: bool) -> None:
    if group_size < 2:
        raise ValueError(f"advantage estimator rloo needs at least 2 responses per prompt (got {group_size}): the "
                         "baseline is the mean of the others; set rollout.n >= 2 or algo.advantage_estimator=grpo")
    if norm_by_std:
        raise ValueError("advantage estimator rloo takes no std normalization: set algo.norm_adv_by_std=false "
                         "(or algo.advantage_estimator=grpo)")


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Spread per-response advantages ``[B]`` over response tokens: ``[B, T]``, 0 where ``mask`` is 0."""
    if advantages.dim() != 1 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] with B = mask rows {mask.shape[0]}")
    adv = advantages if advantages.is_floating_point() else advantages.float()
    return adv.unsqueeze(-1) * mask.to(adv.dtype)
