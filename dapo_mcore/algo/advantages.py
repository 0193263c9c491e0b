"""Group-normalized outcome advantages (GRPO/DAPO): A_i = (R_i - mean(R_group)) / (std(R_group) + eps)."""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages of ``rewards [num_groups, G]`` (one row per prompt, G responses each), same shape.

    The std is the unbiased estimator (divisor G - 1), as in verl; a group of size 1 gets mean 0 and std 1,
    so its advantage is ``R / (1 + eps)`` (``R`` without std normalization). Computed in float64 at least.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    dtype = torch.promote_types(rewards.dtype, torch.float64)
    r = rewards.to(dtype)
    if r.shape[1] == 1:
        mean = torch.zeros_like(r)
        std = torch.ones_like(r)
    else:
        mean = r.mean(dim=1, keepdim=True)
        std = r.std(dim=1, unbiased=True, keepdim=True)
    centred = r - mean
    adv = centred / (std + eps) if norm_by_std else centred
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Spread per-response advantages ``[B]`` over response tokens: ``[B, T]``, 0 where ``mask`` is 0."""
    if advantages.dim() != 1 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] with B = mask rows {mask.shape[0]}")
    adv = advantages if advantages.is_floating_point() else advantages.float()
    return adv.unsqueeze(-1) * mask.to(adv.dtype)
