"""Top-k / top-p masks and next-token log-probs against naive per-row loops."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_mcore.rollout import SamplingParams
from dapo_mcore.rollout.engines.sampling import apply_top_k, apply_top_p, sample_next

pytestmark = pytest.mark.unit


def naive_top_k(row: list[float], k: int) -> set[int]:
    kth = sorted(row, reverse=True)[k - 1]
    return {i for i, v in enumerate(row) if v >= kth}


def naive_top_p(row: list[float], p: float) -> set[int]:
    z = max(row)
    probs = [math.exp(v - z) for v in row]
    total = sum(probs)
    order = sorted(range(len(row)), key=lambda i: -row[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i] / total
    return kept


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(r).nonzero().squeeze(-1).tolist()) for r in masked]


@pytest.mark.parametrize("k", [1, 3, 7, 31])
def test_top_k_matches_naive(k):
    torch.manual_seed(k)
    logits = torch.randn(6, 31)
    assert kept(apply_top_k(logits, k)) == [naive_top_k(r.tolist(), k) for r in logits]
    assert torch.equal(apply_top_k(logits, -1), logits)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.95])
def test_top_p_matches_naive(p):
    torch.manual_seed(int(p * 100))
    logits = 2.0 * torch.randn(8, 25)
    masked = apply_top_p(logits, p)
    assert kept(masked) == [naive_top_p(r.tolist(), p) for r in logits]
    finite = torch.isfinite(masked)
    assert torch.equal(masked[finite], logits[finite])  # kept logits untouched
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def test_sample_next_logprobs_and_support():
    torch.manual_seed(0)
    logits = torch.randn(5, 32)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.9)
    tokens, logp = sample_next(logits, params, gen)
    for i in range(5):
        row = (logits[i] / 0.5).tolist()
        z = max(row)
        lse = z + math.log(sum(math.exp(v - z) for v in row))
        assert logp[i].item() == pytest.approx(row[tokens[i]] - lse, abs=1e-5)  # full vocabulary, before truncation
        assert tokens[i].item() in naive_top_k(row, 4) & naive_top_p(
            [v if j in naive_top_k(row, 4) else -1e30 for j, v in enumerate(row)], 0.9)
    greedy_tokens, greedy_logp = sample_next(logits, SamplingParams(temperature=0.0, logprobs="raw"), None)
    assert torch.equal(greedy_tokens, logits.argmax(-1))
    assert torch.allclose(greedy_logp, torch.log_softmax(logits, -1).max(-1).values, atol=1e-6)


def test_sample_next_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).expand(20000, 4)
    gen = torch.Generator().manual_seed(1)
    tokens, _ = sample_next(logits, SamplingParams(temperature=1.0), gen)
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.015)
    tokens, _ = sample_next(logits, SamplingParams(temperature=1.0, top_p=0.6), gen)
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()  # nucleus {0, 1}, renormalised
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015)
