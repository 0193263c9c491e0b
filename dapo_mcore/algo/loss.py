"""The policy-gradient loss (DAPO's clipped token ratio, GSPO, CISPO) and its aggregation modes (pure torch).

Objectives (``policy_loss(objective=...)``, :data:`OBJECTIVES`):

* ``ppo_clip``: PPO's clipped token ratio ``r_t = exp(logp_t - old_logp_t)`` (DAPO, GRPO).
* ``gspo``: GSPO's sequence ratio ``s_i = exp(mean_t (logp_t - old_logp_t))`` over the response's tokens, used for every
  token as ``sg(s_i) * exp(logp_t - sg(logp_t))`` (value ``s_i``, gradient ``s_i`` times that of ``logp_t``) in the same
  clipped surrogate; with ``seq-mean-token-mean`` this is GSPO's sequence objective, value and gradient.
* ``cispo``: CISPO (MiniMax-M1): ``-sg(clip(r_t)) * A * logp_t``: the clip bounds the importance weight, it never
  zeroes a token's gradient.

Shapes: every tensor is ``[B, T]``: one row per response, response tokens only, ``mask`` 1 on real tokens
(all-zero rows are allowed: empty or overlong-filtered responses). ``advantages`` may also be ``[B]``.

Split invariance: the loss is a *contribution*. The caller passes the mini-batch totals ``global_tokens``
(response tokens with mask 1, summed over every micro-batch and data-parallel rank) and ``global_seqs``
(responses with at least one masked-in token, same scope; see :func:`loss_denominators`). Summing the returned
loss over micro-batches and ranks then gives exactly the mini-batch loss, so the gradient does not depend on how
the mini-batch was split. Gradients must therefore be SUMMED (not averaged) across data-parallel ranks and
micro-batches. Every metric is a contribution in the same sense (summing gives the mini-batch value).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AggFn = Callable[..., Tensor]
_AGG_MODES: dict[str, AggFn] = {}


def register_loss_agg(name: str) -> Callable[[AggFn], AggFn]:
    """Register an aggregation ``fn(token_loss, mask, *, global_tokens, global_seqs, max_response_len)``."""

    def deco(fn: AggFn) -> AggFn:
        if name in _AGG_MODES:
            raise ValueError(f"loss aggregation {name!r} is already registered; pick another name")
        _AGG_MODES[name] = fn
        return fn

    return deco


def loss_agg_names() -> list[str]:
    """Names of the registered aggregation modes, in registration order."""
    return list(_AGG_MODES)


def get_loss_agg(name: str) -> AggFn:
    """Look up an aggregation mode by name; the error lists the valid names."""
    if name not in _AGG_MODES:
        raise ValueError(f"unknown loss aggregation {name!r}; valid: {', '.join(_AGG_MODES)}")
    return _AGG_MODES[name]


def _check_denominator(value: float, what: str) -> None:
    if value <= 0:
        raise ValueError(
            f"{what}={value} must be > 0: pass the count over the whole mini-batch "
            "(sum loss_denominators() over micro-batches and all-reduce over data-parallel ranks)"
        )


@register_loss_agg("token-mean")
def _token_mean(token_loss: Tensor, mask: Tensor, *, global_tokens: float, **_: object) -> Tensor:
    """DAPO: sum over all tokens of all responses / total response tokens of the mini-batch."""
    _check_denominator(global_tokens, "global_tokens")
    return (token_loss * mask).sum() / global_tokens


def _per_seq_sums(token_loss: Tensor, mask: Tensor) -> Tensor:
    return (token_loss * mask).sum(dim=-1)


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(token_loss: Tensor, mask: Tensor, *, global_seqs: float, **_: object) -> Tensor:
    """GRPO: mean over sequences of per-sequence token means (empty rows contribute 0)."""
    _check_denominator(global_seqs, "global_seqs")
    lengths = mask.sum(dim=-1)
    per_seq = _per_seq_sums(token_loss, mask) / lengths.clamp(min=1)
    return per_seq.sum() / global_seqs


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(token_loss: Tensor, mask: Tensor, *, global_seqs: float, **_: object) -> Tensor:
    """Mean over sequences of per-sequence token sums."""
    _check_denominator(global_seqs, "global_seqs")
    return _per_seq_sums(token_loss, mask).sum() / global_seqs


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    token_loss: Tensor, mask: Tensor, *, global_seqs: float, max_response_len: int | None, **_: object
) -> Tensor:
    """Dr. GRPO: per-sequence token sums divided by a constant horizon (max_response_len), mean over sequences."""
    _check_denominator(global_seqs, "global_seqs")
    if max_response_len is None or max_response_len <= 0:
        raise ValueError(
            "loss_agg='seq-mean-token-sum-norm' needs max_response_len > 0 (the configured maximum response "
            "length, a constant: the padded width of a micro-batch would make the loss depend on the split)"
        )
    return _per_seq_sums(token_loss, mask).sum() / (max_response_len * global_seqs)


def loss_denominators(mask: Tensor) -> tuple[int, int]:
    """Local ``(tokens, seqs)`` of one micro-batch: masked-in tokens and rows with at least one of them.

    Sum these over the micro-batches of a mini-batch and all-reduce over data-parallel ranks to get the
    ``global_tokens`` / ``global_seqs`` that :func:`policy_loss` expects.
    """
    lengths = mask.sum(dim=-1)
    return int(lengths.sum().item()), int((lengths > 0).sum().item())


def clipped_token_loss(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip_c: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO loss with asymmetric clip and optional dual clip.

    Returns ``(token_loss, clip_active, dual_active)``: ``clip_active`` where the clipped branch is strictly
    larger (r > 1+eps_high with A > 0, or r < 1-eps_low with A < 0); ``dual_active`` where A < 0 and the dual
    clip bound -A*c replaced the clipped loss.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    bound = -advantages * dual_clip_c
    negative = advantages < 0
    dual_active = negative & (loss > bound)
    loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return loss, clip_active, dual_active


OBJECTIVES = ("ppo_clip", "gspo", "cispo")
"""The policy objectives :func:`policy_loss` knows (``algo.objective``)."""


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's ``log s_i``: the mean of ``log_ratio [B, T]`` over each row's masked-in tokens, ``[B, 1]`` (0 on empty
    rows). Every response lies whole in one micro-batch row, so this is the same whatever the split."""
    return (log_ratio * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)


def objective_token_loss(objective: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                         clip_low: float, clip_high: float, dual_clip_c: float | None
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(token_loss, clip_active, dual_active, ratio)`` of one objective, all ``[B, T]``; ``mask`` already holds
    ``keep``. ``clip_active`` marks where the clip bound is active: for ppo_clip and gspo where the clipped branch is
    the larger loss (gspo: per sequence, on each of its tokens), for cispo where the weight was truncated.
    ``ratio`` is the (detached) ratio the clip reads, for logging."""
    log_ratio = logp - old_logp
    if objective == "ppo_clip":
        ratio = torch.exp(log_ratio)
        loss, clip_active, dual_active = clipped_token_loss(ratio, advantages, clip_low, clip_high, dual_clip_c)
        return loss, clip_active, dual_active, ratio.detach()
    if dual_clip_c is not None:
        raise ValueError(f"dual_clip_c={dual_clip_c} belongs to the ppo_clip objective; set it to None for "
                         f"objective={objective!r}")
    if objective == "gspo":
        seq = torch.exp(sequence_log_ratio(log_ratio, mask).detach())
        ratio = seq * torch.exp(logp - logp.detach())  # value s_i, d/dlogp_t = s_i
        loss, clip_active, dual_active = clipped_token_loss(ratio, advantages, clip_low, clip_high, None)
        return loss, clip_active, dual_active, seq.expand_as(logp)
    if objective == "cispo":
        ratio = torch.exp(log_ratio.detach())
        weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        clip_active = weight != ratio
        return -weight * advantages * logp, clip_active, torch.zeros_like(clip_active), ratio
    raise ValueError(f"unknown objective {objective!r}; valid: {', '.join(OBJECTIVES)}")


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
    agg: str = "token-mean",
    global_tokens: float,
    global_seqs: float,
    max_response_len: int | None = None,
    tis_weights: Tensor | None = None,
    keep: Tensor | None = None,
    objective: str = "ppo_clip",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss contribution of one micro-batch (the objective's token loss, then the aggregation).

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (requires grad).
        old_logp: ``[B, T]`` log-probs under the policy that generated the batch (no grad).
        advantages: ``[B, T]`` or ``[B]`` advantages (the outcome advantage broadcast to every token).
        mask: ``[B, T]`` 1 on the response tokens the model sampled, 0 on padding, on overlong-filtered rows and on
            tool-output tokens (multi-turn rollouts: ``TrainSample.loss_mask``). A masked token's ``old_logp``
            and ``tis_weights`` are never read (NaN allowed): it counts in no loss, metric or denominator.
        clip_low, clip_high: ratio clipped to ``[1 - clip_low, 1 + clip_high]`` (DAPO: 0.2, 0.28; GSPO: 3e-4, 4e-4
            on the sequence ratio; CISPO: the importance weight's bounds).
        dual_clip_c: for A < 0, cap the token loss at ``-A * c`` (c > 1); None disables it (ppo_clip only).
        agg: a registered aggregation mode (:func:`loss_agg_names`).
        global_tokens, global_seqs: mini-batch totals (:func:`loss_denominators`, summed and all-reduced).
        max_response_len: the constant horizon of ``seq-mean-token-sum-norm``.
        tis_weights: optional ``[B, T]`` truncated importance weights for engine-vs-actor mismatch
            (``dapo_mcore.rollout.correction.mismatch.tis_weights``), multiplied into the token loss without gradient;
            or any rollout-correction weights (``dapo_mcore.algo.rollout_correction.correction``).
        keep: optional ``[B, T]`` rejection mask (``correction``'s ``keep``): a token with keep 0 leaves the loss
            and every metric, so ``global_tokens``/``global_seqs`` must count ``mask * keep``
            (:func:`loss_denominators` of it). GSPO's sequence ratio is the mean over the kept tokens.
        objective: one of :data:`OBJECTIVES` (module docstring).

    Returns:
        ``(loss, metrics)``: the scalar loss contribution and detached metric contributions
        ``pg_loss, clipfrac, clipfrac_low, clipfrac_high, dual_clipfrac, ppo_kl`` (+ ``tis_weight`` if used).
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
                         f"{tuple(mask.shape)} must all be [B, T]")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    agg_fn = get_loss_agg(agg)
    _check_denominator(global_tokens, "global_tokens")
    mask = mask.to(logp.dtype)
    if keep is not None:
        mask = mask * keep.detach().to(logp.dtype)
    # A masked-out token never enters the arithmetic: a tool-output token's engine log-prob is NaN (bypass mode
    # uses it as old_logp), and NaN * 0 is NaN in the value and in the gradient. Give it ratio 1 and weight 1.
    counted = mask > 0
    old_logp = torch.where(counted, old_logp.detach().to(logp.dtype), logp.detach())
    advantages = advantages.detach().to(logp.dtype).expand_as(logp)
    token_loss, clip_active, dual_active, ratio = objective_token_loss(objective, logp, old_logp, advantages, mask,
                                                                   clip_low, clip_high, dual_clip_c)
    if tis_weights is not None:
        tis_weights = torch.where(counted, tis_weights.detach().to(logp.dtype), 1.0)
        token_loss = token_loss * tis_weights
    loss = agg_fn(token_loss, mask, global_tokens=global_tokens, global_seqs=global_seqs,
                  max_response_len=max_response_len)

    def frac(flags: Tensor) -> Tensor:
        return (flags.to(logp.dtype) * mask).sum().detach() / global_tokens

    metrics = {
        "pg_loss": loss.detach(),
        "clipfrac": frac(clip_active),
        "clipfrac_low": frac(clip_active & (ratio < 1.0)),  # ppo_clip/gspo: = clipped with A < 0
        "clipfrac_high": frac(clip_active & (ratio > 1.0)),
        "dual_clipfrac": frac(dual_active),
        "ppo_kl": ((old_logp - logp.detach()) * mask).sum() / global_tokens,
    }
    if tis_weights is not None:
        metrics["tis_weight"] = (tis_weights * mask).sum() / global_tokens
    return loss, metrics


def masked_entropy_contrib(entropy: Tensor, mask: Tensor, global_tokens: float) -> Tensor:
    """Contribution of one micro-batch to the token-mean entropy of the mini-batch (logged, not optimized)."""
    _check_denominator(global_tokens, "global_tokens")
    return (entropy.detach() * mask.to(entropy.dtype)).sum() / global_tokens


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution per position: ``[..., V] -> [...]`` (full vocabulary)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
