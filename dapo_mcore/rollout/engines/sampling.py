"""Next-token sampling for the HF engine: temperature, top-k, top-p, and the returned log-probabilities.

Order and conventions follow vLLM's sampler so both engines sample the same distribution: logits in fp32,
divide by the temperature, mask to the top-k, then to the top-p nucleus, sample. Temperature 0 (or
top_k 1) is argmax. The returned log-prob is defined in ``SamplingParams.logprobs``: by default
``log_softmax(logits / T)`` of the chosen token over the full vocabulary, before any truncation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_mcore.rollout.protocol import SamplingParams

__all__ = ["apply_top_k", "apply_top_p", "sample_next"]


def apply_top_k(logits: Tensor, k: int) -> Tensor:
    """Set every logit below the k-th largest of its row to -inf (k = -1 or k >= vocab: unchanged).

    Ties with the k-th value are kept (as vLLM does), so a row may keep more than k tokens.
    """
    if k == -1 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``; the rest -> -inf.

    A token is dropped when the mass of the tokens ranked above it already reaches ``p``; the most likely
    token is always kept.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Sample one token per row of ``logits`` ``[B, V]``; returns ``(tokens [B] int64, logprobs [B] fp32)``.

    Log-probs follow ``params.logprobs`` (zeros for "none").
    """
    logits = logits.float()
    temperature = params.temperature if params.temperature > 0 else 1.0
    scaled = logits / temperature
    if params.greedy:
        tokens = scaled.argmax(dim=-1)
    else:
        masked = apply_top_p(apply_top_k(scaled, params.top_k), params.top_p)
        probs = torch.softmax(masked, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if params.logprobs == "none":
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32)
    source = scaled if params.logprobs == "processed" else logits
    chosen = source.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen - torch.logsumexp(source, dim=-1)
