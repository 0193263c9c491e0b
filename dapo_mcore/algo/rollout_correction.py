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
  (``group``: the sums are all-reduced over it); nothing here reads Megatron's global state.
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
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PRESETS", "RS_OPTIONS", "CorrectionStats", "RolloutCorrectionConfig", "correction",
           "correction_packed", "correction_stats"]

LOG_CLAMP = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_mean_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""Rejection options; ``*_k1`` take a ratio band (lo, hi), the others an upper bound u."""

Threshold = float | list[float]


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the rollout engine's and the trainer's log-probs (verl's rollout correction).

    Leave the fields at their defaults and set ``preset`` for a named recipe; a field set away from its default
    overrides the preset's value.
    """

    is_level: str | None = None
    """Importance weights: token (w_t = r_t), sequence (w = prod_t r_t for every token), or null (none)."""
    is_threshold: float | list[float] | None = None
    """A number C truncates w to min(w, C) (TIS, typical 2.0); a pair [lo, hi] zeroes w outside it (IcePop)."""
    is_batch_normalize: bool = False
    """Divide the truncated weights by their mean over the global batch (tokens or responses, by is_level)."""
    rs: list[str] = field(default_factory=list)
    """Rejection options, all must pass: token_k1/k2/k3, seq_sum_k1, seq_mean_k1 (Geo-RS), seq_{sum,mean,max}_k{2,3}."""
    rs_thresholds: list[float | list[float]] = field(default_factory=list)
    """One per rs option: a ratio band [lo, hi] for *_k1, an upper bound u for k2/k3."""
    bypass: bool = False
    """Skip the old-log-prob pass: the PPO ratio is pi_theta / pi_rollout; weights and rejection use pi_theta."""
    preset: str | None = None
    """A named recipe (PRESETS): token_tis, seq_tis, seq_mis, icepop, geo_rs, geo_rs_token_tis, k3_rs,
    bypass_ppo_clip, bypass_ppo_clip_geo_rs, disabled."""

    def __post_init__(self) -> None:
        if isinstance(self.rs, str):
            self.rs = [self.rs]
        self.rs = list(self.rs or [])
        t = self.rs_thresholds if self.rs_thresholds is not None else []
        if isinstance(t, (int, float)):
            t = [t]
        elif (len(self.rs) == 1 and isinstance(t, (list, tuple)) and len(t) == 2
              and all(isinstance(v, (int, float)) for v in t) and self.rs[0].endswith("k1")):
            t = [list(t)]  # one k1 option given its band directly
        self.rs_thresholds = [list(v) if isinstance(v, (list, tuple)) else v for v in t]
        if isinstance(self.is_threshold, tuple):
            self.is_threshold = list(self.is_threshold)

    def resolved(self) -> RolloutCorrectionConfig:
        """The preset's values for the fields left at their defaults (itself when no preset is set)."""
        if self.preset is None:
            return self
        if self.preset not in PRESETS:
            raise ValueError(f"algo.rollout_correction.preset={self.preset!r} is unknown; valid: {', '.join(PRESETS)}")
        base, default = PRESETS[self.preset], RolloutCorrectionConfig()
        values = {f.name: getattr(self, f.name) if getattr(self, f.name) != getattr(default, f.name)
                  else getattr(base, f.name) for f in fields(self) if f.name != "preset"}
        return RolloutCorrectionConfig(**values)

    @property
    def active(self) -> bool:
        """Whether it changes the loss at all (weights, rejection or bypass)."""
        r = self.resolved()
        return r.is_level is not None or bool(r.rs) or r.bypass

    def validate(self, key: str = "algo.rollout_correction") -> None:
        """Raise ValueError naming the key and the fix for a bad setting."""
        r = self.resolved()
        if r.is_level not in (None, "token", "sequence"):
            raise ValueError(f"{key}.is_level={r.is_level!r} is unknown; use token, sequence or null")
        if r.is_threshold is not None:
            _check_threshold(f"{key}.is_threshold", r.is_threshold, pair_ok=True, number_ok=True)
        elif r.is_level is not None:
            raise ValueError(f"{key}.is_threshold is needed with is_level={r.is_level!r}: a cap (e.g. 2.0) or an "
                             "IcePop band [lo, hi] (e.g. [0.5, 5.0])")
        unknown = [o for o in r.rs if o not in RS_OPTIONS]
        if unknown:
            raise ValueError(f"{key}.rs: unknown option(s) {unknown}; valid: {', '.join(RS_OPTIONS)}")
        if len(set(r.rs)) != len(r.rs):
            raise ValueError(f"{key}.rs={r.rs} names an option twice; give each once")
        if len(r.rs_thresholds) != len(r.rs):
            raise ValueError(f"{key}.rs_thresholds has {len(r.rs_thresholds)} value(s) for {len(r.rs)} rs option(s); "
                             "give one per option ([lo, hi] for *_k1, a number for k2/k3)")
        for i, (opt, thr) in enumerate(zip(r.rs, r.rs_thresholds, strict=True)):
            k1 = opt.endswith("k1")
            _check_threshold(f"{key}.rs_thresholds[{i}] ({opt})", thr, pair_ok=k1, number_ok=not k1)


def _check_threshold(key: str, value: Threshold, *, pair_ok: bool, number_ok: bool) -> None:
    if isinstance(value, list):
        if not pair_ok:
            raise ValueError(f"{key}={value}: a pair where a number is required; give one upper bound (e.g. 0.01)")
        if len(value) != 2:
            raise ValueError(f"{key}={value}: a band is two numbers [lo, hi] (e.g. [0.5, 2.0])")
        lo, hi = value
        if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"{key}={value}: both bounds must be positive finite numbers (e.g. [0.5, 2.0])")
        if lo > hi:
            raise ValueError(f"{key}={value}: lo > hi; give [lo, hi] with lo <= hi (e.g. [0.5, 2.0])")
        return
    if not number_ok:
        raise ValueError(f"{key}={value}: a number where a band [lo, hi] is required (e.g. [0.999, 1.001])")
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{key}={value!r}: must be a positive finite number (e.g. 2.0)")


PRESETS: dict[str, RolloutCorrectionConfig] = {
    "disabled": RolloutCorrectionConfig(),
    "token_tis": RolloutCorrectionConfig(is_level="token", is_threshold=2.0),
    "seq_tis": RolloutCorrectionConfig(is_level="sequence", is_threshold=2.0),
    "seq_mis": RolloutCorrectionConfig(is_level="sequence", is_threshold=2.0, rs=["seq_sum_k1"],
                                       rs_thresholds=[[0.5, 2.0]]),
    "icepop": RolloutCorrectionConfig(is_level="token", is_threshold=[0.5, 5.0]),
    "geo_rs": RolloutCorrectionConfig(rs=["seq_mean_k1"], rs_thresholds=[[0.999, 1.001]]),
    "geo_rs_token_tis": RolloutCorrectionConfig(is_level="token", is_threshold=2.0, rs=["seq_mean_k1"],
                                                rs_thresholds=[[0.999, 1.001]]),
    "k3_rs": RolloutCorrectionConfig(rs=["seq_mean_k3"], rs_thresholds=[0.01]),
    "bypass_ppo_clip": RolloutCorrectionConfig(bypass=True),
    "bypass_ppo_clip_geo_rs": RolloutCorrectionConfig(rs=["seq_mean_k1"], rs_thresholds=[[0.999, 1.001]],
                                                      bypass=True),
}
"""Named recipes, thresholds as verl's RolloutCorrectionConfig factories (IcePop's band [0.5, 5] from its paper)."""


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
            if group is not None:
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
