"""Rollout correction: importance weights and rejection masks for the gap between the policy that sampled a batch
(the rollout engine: other kernels, bf16/FP8, an older version in async mode) and the policy that trains on it.

Pure torch. On each response token t with mask 1, ``log r_t = logp_train(t) - logp_rollout(t)`` clamped to
[-20, 20] (``logp_train``: pi_old's log-prob in the decoupled mode; pi_theta's, detached, in bypass mode). Masked
tokens never contribute: their values (even NaN) are replaced before any arithmetic.

- IS weights (``is_level``): ``token``: w_t = exp(log r_t); ``sequence``: w_t = exp(clamp(sum_t log r_t, -20, 20)),
  the same for every token of a response; None: 1.
- Truncation (``is_threshold``): a number C: w = min(w, C) (TIS); a pair (lo, hi): w if lo <= w <= hi else 0
  (IcePop: zeroed outside the band, not clipped).
- Batch normalization (``is_batch_normalize``): after truncation, w / mean(w), the mean over the global batch's valid
  tokens (token level) or responses (sequence level). Pass the global mean in (``weight_mean``) or a process group
  (``group``: the sums are all-reduced over it, on its collective device); nothing here reads Megatron's global
  state.
- Rejection (``rs``/``rs_thresholds``, all must pass): k1 = log r, k2 = (log r)^2/2, k3 = r - 1 - log r per token.
  ``token_k1`` keeps lo <= r_t <= hi; ``token_k2``/``token_k3`` keep k <= u; ``seq_sum_k1``/``seq_mean_k1`` (Geo-RS)
  keep a response if lo <= exp(clamp(sum/mean of k1, -20, 20)) <= hi; ``seq_{sum,mean,max}_k{2,3}`` keep it if the
  sum/mean/max over its valid tokens <= u. A rejected token leaves the loss and the token-level denominator.
- Bypass (``bypass``): no old-log-prob pass; pi_old := pi_rollout in the PPO ratio (the actor's business).

:func:`correction` works on padded ``[B, T]`` tensors; :func:`correction_packed` on responses concatenated into one
flat tensor (how the trainer holds a step's batch). :class:`CorrectionStats` holds additive sums (merge over
micro-batches and ranks, then :meth:`CorrectionStats.metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

from dapo_mcore.algo.rollout_correction_config import (  # the settings live torch-free (re-exported here)
    LOG_CLAMP,
    PRESETS,
    RS_OPTIONS,
    RolloutCorrectionConfig,
)
from dapo_mcore.collectives.device import collective_device

__all__ = ["LOG_CLAMP", "PRESETS", "RS_OPTIONS", "CorrectionStats", "RolloutCorrectionConfig", "correction",
           "correction_packed", "correction_stats"]


@dataclass
class CorrectionStats:
    """Additive statistics of a correction (sums over valid tokens / responses); merge, then :meth:`metrics`."""

    tokens: float = 0.0
    seqs: float = 0.0
    w_sum: float = 0.0
    w_sq_sum: float = 0.0
    w_min: float = math.inf
    w_max: float = -math.inf
    rejected_tokens: float = 0.0
    rejected_seqs: float = 0.0
    k1_sum: float = 0.0
    k3_sum: float = 0.0
    r2_sum: float = 0.0
    seq_mean_k1_sum: float = 0.0
    norm_sum: float = 0.0
    """Truncated, unnormalized weights summed over the batch-normalization units (tokens or responses)."""
    norm_count: float = 0.0

    def merge(self, other: CorrectionStats) -> CorrectionStats:
        out = CorrectionStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                                 if f.name not in ("w_min", "w_max")})
        out.w_min, out.w_max = min(self.w_min, other.w_min), max(self.w_max, other.w_max)
        return out

    def metrics(self, prefix: str = "rollout_corr/") -> dict[str, float]:
        """Per-token (KL, chi-squared, weights) and per-response (log-PPL difference, rejection) means."""
        n, s = self.tokens, self.seqs
        if n == 0:
            return {}
        out = {"is_weight_mean": self.w_sum / n, "is_weight_min": self.w_min, "is_weight_max": self.w_max,
               "ess": self.w_sum ** 2 / (n * self.w_sq_sum) if self.w_sq_sum > 0 else 0.0,
               "rejected_token_frac": self.rejected_tokens / n, "rejected_seq_frac": self.rejected_seqs / max(s, 1),
               # log r = train - rollout: KL(rollout || train) is E_rollout[-log r] (k1), E[r - 1 - log r] (k3).
               "kl_k1": -self.k1_sum / n, "kl_k3": self.k3_sum / n, "chi2": self.r2_sum / n - 1.0,
               "log_ppl_diff": -self.seq_mean_k1_sum / max(s, 1)}
        return {prefix + k: float(v) for k, v in out.items()}

    def as_vector(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]


def _seq_stat(values: Tensor, m: Tensor, how: str) -> Tensor:
    n = m.sum(-1)
    if how == "sum":
        return (values * m).sum(-1)
    if how == "mean":
        return (values * m).sum(-1) / n.clamp(min=1)
    return torch.where(m.bool(), values, torch.full_like(values, -math.inf)).amax(-1)


def _keep_mask(lr: Tensor, m: Tensor, cfg: RolloutCorrectionConfig) -> Tensor:
    keep = m.bool().clone()
    if not cfg.rs:
        return keep
    k = {"k1": lr, "k2": lr * lr / 2, "k3": torch.expm1(lr) - lr}
    for opt, thr in zip(cfg.rs, cfg.rs_thresholds, strict=True):
        level, *how, kind = opt.split("_")
        if level == "token":
            ok = (torch.exp(lr) >= thr[0]) & (torch.exp(lr) <= thr[1]) if kind == "k1" else k[kind] <= thr
        else:
            stat = _seq_stat(k[kind], m, how[0])
            ratio = torch.exp(stat.clamp(-LOG_CLAMP, LOG_CLAMP))
            row_ok = (ratio >= thr[0]) & (ratio <= thr[1]) if kind == "k1" else stat <= thr
            ok = row_ok.unsqueeze(-1).expand_as(lr)
        keep &= ok
    return keep


def _raw_weights(lr: Tensor, m: Tensor, cfg: RolloutCorrectionConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated weights ``[B, T]`` (0 on masked tokens) and the per-unit values and mask batch normalization uses."""
    if cfg.is_level is None:
        w = m.clone()
        return w, w, m
    if cfg.is_level == "token":
        w = torch.exp(lr)
    else:
        w = torch.exp((lr * m).sum(-1).clamp(-LOG_CLAMP, LOG_CLAMP)).unsqueeze(-1).expand_as(lr)
    thr = cfg.is_threshold
    if isinstance(thr, list):
        w = torch.where((w >= thr[0]) & (w <= thr[1]), w, torch.zeros_like(w))
    elif thr is not None:
        w = w.clamp(max=thr)
    w = w * m
    if cfg.is_level == "sequence":
        return w, w.amax(-1) if w.shape[1] else w.sum(-1), (m.sum(-1) > 0).to(m.dtype)
    return w, w, m


def correction_stats(log_ratio: Tensor, mask: Tensor, cfg: RolloutCorrectionConfig, *,
                     weight_mean: float | Tensor | None = None, group: dist.ProcessGroup | None = None
                     ) -> tuple[Tensor, Tensor, CorrectionStats]:
    """:func:`correction` with the additive :class:`CorrectionStats` instead of the metrics dict.

    ``weight_mean``: the global mean for batch normalization (skips the reduction: pass 1.0 to apply it later);
    else the local sums, all-reduced over ``group`` when given.
    """
    cfg = cfg.resolved()
    if log_ratio.shape != mask.shape or log_ratio.dim() != 2:
        raise ValueError(f"log_ratio {tuple(log_ratio.shape)} and mask {tuple(mask.shape)} must both be [B, T]")
    dtype = torch.promote_types(log_ratio.dtype, torch.float32)
    m = mask.detach().to(dtype)
    valid = m.bool()
    lr = torch.where(valid, log_ratio.detach().to(dtype), torch.zeros((), dtype=dtype, device=m.device))
    lr = lr.clamp(-LOG_CLAMP, LOG_CLAMP)
    w, units, unit_mask = _raw_weights(lr, m, cfg)
    norm_sum, norm_count = (units * unit_mask).sum(), unit_mask.sum()
    if cfg.is_batch_normalize and cfg.is_level is not None:
        if weight_mean is None:
            sums = torch.stack([norm_sum, norm_count])
            if group is not None:  # on the group's device (the GPU under NCCL, where the sums already are: no copy)
                sums = collective_device(group).to(sums)
                dist.all_reduce(sums, group=group)
            weight_mean = sums[0] / sums[1] if sums[1] > 0 else sums.new_ones(())
        if float(weight_mean) > 0:
            w = w / weight_mean
    keep = _keep_mask(lr, m, cfg)
    stats = _stats(lr, m, w, keep, float(norm_sum), float(norm_count))
    return w, keep, stats


def _stats(lr: Tensor, m: Tensor, w: Tensor, keep: Tensor, norm_sum: float, norm_count: float) -> CorrectionStats:
    valid = m.bool()
    n_tok = m.sum(-1)
    rows = n_tok > 0
    if not bool(valid.any()):
        return CorrectionStats()
    r = torch.exp(lr)
    wv = w[valid]
    rejected_rows = rows & ~(keep & valid).any(-1)
    return CorrectionStats(
        tokens=float(m.sum()), seqs=float(rows.sum()), w_sum=float(wv.sum()), w_sq_sum=float((wv * wv).sum()),
        w_min=float(wv.min()), w_max=float(wv.max()), rejected_tokens=float((valid & ~keep).sum()),
        rejected_seqs=float(rejected_rows.sum()), k1_sum=float((lr * m).sum()),
        k3_sum=float(((torch.expm1(lr) - lr) * m).sum()), r2_sum=float((r * r * m).sum()),
        seq_mean_k1_sum=float(((lr * m).sum(-1) / n_tok.clamp(min=1))[rows].sum()),
        norm_sum=norm_sum, norm_count=norm_count)


def correction(log_ratio: Tensor, mask: Tensor, cfg: RolloutCorrectionConfig, *,
               weight_mean: float | Tensor | None = None, group: dist.ProcessGroup | None = None
               ) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Weights and keep mask of a padded batch.

    Args:
        log_ratio: ``[B, T]`` logp_train - logp_rollout per response token (any value, NaN included, where masked).
        mask: ``[B, T]`` 1 on valid response tokens.
        cfg: the correction (a preset is resolved).
        weight_mean, group: batch normalization's global mean, or the group to all-reduce the local sums over.

    Returns:
        ``(weights, keep, metrics)``: ``weights`` ``[B, T]`` (0 on masked tokens; 1 on valid ones without IS),
        ``keep`` ``[B, T]`` bool (False on masked and rejected tokens), ``metrics`` the ``rollout_corr/*`` means.
    """
    w, keep, stats = correction_stats(log_ratio, mask, cfg, weight_mean=weight_mean, group=group)
    return w, keep, stats.metrics()


def correction_packed(log_ratio: Tensor, lengths: Sequence[int], mask: Tensor, cfg: RolloutCorrectionConfig, *,
                      weight_mean: float | Tensor | None = None, group: dist.ProcessGroup | None = None
                      ) -> tuple[Tensor, Tensor, CorrectionStats]:
    """:func:`correction_stats` on responses concatenated into flat ``[sum(lengths)]`` tensors (same order out)."""
    total = int(sum(lengths))
    if log_ratio.shape != (total,) or mask.shape != (total,):
        raise ValueError(f"log_ratio {tuple(log_ratio.shape)} and mask {tuple(mask.shape)} must be [{total}]")
    width = max(max(lengths, default=0), 1)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(list(lengths), dtype=torch.long))
    starts = torch.cumsum(torch.as_tensor([0, *lengths[:-1]], dtype=torch.long), 0) if len(lengths) else rows
    cols = torch.arange(total) - starts[rows] if total else rows
    padded_lr = log_ratio.new_zeros(len(lengths), width)
    padded_m = mask.new_zeros(len(lengths), width)
    padded_lr[rows, cols] = log_ratio
    padded_m[rows, cols] = mask
    w, keep, stats = correction_stats(padded_lr, padded_m, cfg, weight_mean=weight_mean, group=group)
    return w[rows, cols], keep[rows, cols], stats
