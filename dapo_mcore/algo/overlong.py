"""DAPO's soft overlong punishment and the overlong-filter loss mask.

R_length(|y|) = 0                                  if |y| <= L_max - L_cache
              = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
              = -1                                 if |y| > L_max
scaled by a penalty factor and added to the correctness reward (so the total lies in [-1 - factor, 1]).
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """Soft overlong punishment ``factor * R_length`` per response, float32 ``[B]`` in ``[-factor, 0]``.

    Args:
        lengths: ``[B]`` generated response lengths in tokens.
        max_len: L_max, the maximum response length.
        cache_len: L_cache, the width of the linear ramp before L_max (0 < cache_len < max_len).
        factor: penalty scale (verl: 1.0).
    """
    if not 0 < cache_len < max_len:
        raise ValueError(f"overlong cache_len={cache_len} must be in (0, max_len={max_len})")
    expected = max_len - cache_len
    lengths = lengths.to(torch.float64)
    ramp = (expected - lengths) / cache_len
    r = torch.where(lengths <= expected, torch.zeros_like(ramp), ramp)
    r = torch.where(lengths > max_len, torch.full_like(ramp, -1.0), r)
    return (factor * r).to(torch.float32)


def overlong_filter_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """Loss mask with the rows of truncated responses zeroed (the paper's "overlong filtering").

    ``mask`` is ``[B, T]``, ``truncated`` a ``[B]`` bool tensor (the response hit the length limit without EOS).
    """
    if truncated.shape != mask.shape[:1]:
        raise ValueError(f"truncated {tuple(truncated.shape)} must be [B] with B = {mask.shape[0]}")
    return mask * (~truncated.bool()).unsqueeze(-1).to(mask.dtype)
