"""Training-inference mismatch: how far the engine's log-probs are from the actor's on the same tokens.

The rollout engine (vLLM in bf16 with its own kernels, or the HF engine) and the Megatron actor compute the
log-probability of the same sampled token differently; with identical weights the gap should be tiny. Per
step we report, over the masked response tokens (``d = engine_logp - actor_logp``):

- ``mean_abs_diff`` / ``max_abs_diff``: mean and max of ``|d|``;
- ``kl_k1``: mean of ``d`` -- an unbiased estimate of KL(engine || actor), tokens being sampled by the engine;
- ``kl_k3``: mean of ``r - 1 - log r`` with ``r = exp(-d) = p_actor / p_engine``: the same KL, low variance
  and never negative (Schulman's k3);
- ``tis_mean`` / ``tis_clip_frac`` (with a cap): mean truncated importance weight and the fraction capped.

:class:`MismatchStats` holds sums so micro-batches and ranks can be merged before the means are taken
(all-reduce SUM on the sums and count, MAX on the max). :func:`tis_weights` gives the truncated importance
weights ``min(exp(actor - engine), cap)`` the loss may multiply in (detached: a correction, not a target).
Tensors of any shape; ``mask`` selects response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dapo_mcore.algo.rollout_correction import RolloutCorrectionConfig, correction_packed

__all__ = ["MismatchStats", "apply_correction", "mismatch_metrics", "tis_weights"]


def tis_weights(actor_logp: Tensor, engine_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance weights ``min(exp(actor_logp - engine_logp), cap)``, detached, same shape.

    ``actor_logp`` are the trainer's old-policy log-probs, ``engine_logp`` the rollout engine's on the same
    tokens. Multiply them (masked) into the per-token policy-gradient loss to correct for the mismatch.
    """
    if cap <= 0:
        raise ValueError(f"tis cap={cap} must be > 0 (typical: 2.0).")
    if actor_logp.shape != engine_logp.shape:
        raise ValueError(f"actor_logp {tuple(actor_logp.shape)} and engine_logp {tuple(engine_logp.shape)} differ")
    dtype = torch.promote_types(torch.promote_types(actor_logp.dtype, engine_logp.dtype), torch.float32)
    ratio = torch.exp(actor_logp.detach().to(dtype) - engine_logp.detach().to(dtype))
    return ratio.clamp(max=cap)


@dataclass
class MismatchStats:
    """Additive mismatch statistics (sums over tokens); merge, then call :meth:`metrics`."""

    tokens: float = 0.0
    sum_abs_diff: float = 0.0
    max_abs_diff: float = 0.0
    sum_k1: float = 0.0
    sum_k3: float = 0.0
    sum_tis: float = 0.0
    tis_clipped: float = 0.0
    has_tis: bool = False

    @classmethod
    def from_tensors(cls, engine_logp: Tensor, actor_logp: Tensor, mask: Tensor,
                     tis_cap: float | None = None) -> MismatchStats:
        """Statistics of one batch: log-probs ``[...]`` and a 0/1 (or bool) ``mask`` of the same shape."""
        if not engine_logp.shape == actor_logp.shape == mask.shape:
            raise ValueError(f"shapes differ: engine {tuple(engine_logp.shape)}, actor {tuple(actor_logp.shape)}, "
                             f"mask {tuple(mask.shape)}")
        m = mask.detach().bool()
        d = (engine_logp.detach().double() - actor_logp.detach().double())[m]
        if d.numel() == 0:
            return cls()
        log_r = -d
        stats = cls(tokens=float(d.numel()), sum_abs_diff=float(d.abs().sum()), max_abs_diff=float(d.abs().max()),
                    sum_k1=float(d.sum()), sum_k3=float((torch.expm1(log_r) - log_r).sum()))
        if tis_cap is not None:
            w = tis_weights(actor_logp.double(), engine_logp.double(), tis_cap)[m]
            stats.sum_tis = float(w.sum())
            stats.tis_clipped = float((torch.exp(log_r) > tis_cap).sum())
            stats.has_tis = True
        return stats

    def merge(self, other: MismatchStats) -> MismatchStats:
        """Combine two batches' statistics."""
        return MismatchStats(
            tokens=self.tokens + other.tokens, sum_abs_diff=self.sum_abs_diff + other.sum_abs_diff,
            max_abs_diff=max(self.max_abs_diff, other.max_abs_diff), sum_k1=self.sum_k1 + other.sum_k1,
            sum_k3=self.sum_k3 + other.sum_k3, sum_tis=self.sum_tis + other.sum_tis,
            tis_clipped=self.tis_clipped + other.tis_clipped, has_tis=self.has_tis or other.has_tis)

    def metrics(self, prefix: str = "mismatch/") -> dict[str, float]:
        """Per-token means (zeros when there were no tokens) and the max, keyed with ``prefix``."""
        n = self.tokens
        out = {"tokens": n, "mean_abs_diff": self.sum_abs_diff / n if n else 0.0,
               "max_abs_diff": self.max_abs_diff, "kl_k1": self.sum_k1 / n if n else 0.0,
               "kl_k3": self.sum_k3 / n if n else 0.0}
        if self.has_tis:
            out["tis_mean"] = self.sum_tis / n if n else 0.0
            out["tis_clip_frac"] = self.tis_clipped / n if n else 0.0
        return {prefix + k: v for k, v in out.items()}


def mismatch_metrics(engine_logp: Tensor, actor_logp: Tensor, mask: Tensor,
                     tis_cap: float | None = None) -> dict[str, float]:
    """One-shot :class:`MismatchStats` metrics of a batch (see the module docstring)."""
    return MismatchStats.from_tensors(engine_logp, actor_logp, mask, tis_cap).metrics()


def apply_correction(samples: Sequence[Any], cfg: RolloutCorrectionConfig) -> dict[str, float]:
    """Decoupled mode: the rollout correction of a step's batch (every rank holds all of it, so the batch mean is
    global), from each sample's ``old_logprobs`` (pi_old) and ``extra["engine_logp"]`` (pi_rollout). Sets
    ``tis_weights`` (with IS weights) and multiplies ``loss_mask`` by the keep mask (with rejection), so the actor's
    token denominators count kept tokens only. Returns the ``rollout_corr/*`` metrics (also without a correction)."""
    lengths = [len(s.response_ids) for s in samples]
    masks = [s.loss_mask if s.loss_mask is not None else torch.ones(n) for s, n in zip(samples, lengths, strict=True)]
    log_ratio = torch.cat([s.old_logprobs.float() - s.extra["engine_logp"].float() for s in samples])
    weights, keep, stats = correction_packed(log_ratio, lengths, torch.cat(masks).float(), cfg)
    offset = 0
    for s, n, mask in zip(samples, lengths, masks, strict=True):
        if cfg.is_level is not None:
            s.tis_weights = weights[offset:offset + n]
        if cfg.rs:
            s.loss_mask = mask * keep[offset:offset + n].to(mask.dtype)
        offset += n
    return stats.metrics()
