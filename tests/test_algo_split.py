"""Split invariance: the gradient of one mini-batch does not depend on its micro-batch split (float64)."""

from __future__ import annotations

import pytest
import torch

from dapo_mcore.algo.loss import loss_denominators, policy_loss

pytestmark = pytest.mark.unit

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LEN = 24


def minibatch(seed: int, b: int = 16, t: int = MAX_LEN):
    """Random mini-batch with very different response lengths (including empty ones)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    logp = old + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[3] = t
    lengths[5] = 0
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return logp, old, adv, mask


def split_loss(logp, old, adv, mask, rows: list[torch.Tensor], mode: str, totals: tuple[int, int]):
    """Sum of micro-batch losses; each micro-batch is trimmed to its own longest response (as packing would)."""
    total = logp.new_zeros(())
    for idx in rows:
        width = max(int(mask[idx].sum(-1).max().item()), 1)
        loss, _ = policy_loss(logp[idx, :width], old[idx, :width], adv[idx], mask[idx, :width],
                              clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, agg=mode,
                              global_tokens=totals[0], global_seqs=totals[1], max_response_len=MAX_LEN)
        total = total + loss
    return total


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_one_vs_four_microbatches(mode, seed):
    logp, old, adv, mask = minibatch(seed)
    logp.requires_grad_(True)
    totals = loss_denominators(mask)
    whole = split_loss(logp, old, adv, mask, [torch.arange(16)], mode, totals)
    (g1,) = torch.autograd.grad(whole, logp)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(seed + 7))
    micro = [perm[i * 4:(i + 1) * 4] for i in range(4)]
    # micro-batch counts summed give the same totals
    assert tuple(map(sum, zip(*(loss_denominators(mask[i]) for i in micro), strict=True))) == totals
    split = split_loss(logp, old, adv, mask, micro, mode, totals)
    (g4,) = torch.autograd.grad(split, logp)
    assert abs(split.item() - whole.item()) <= 1e-12 * max(1.0, abs(whole.item()))
    assert g1.abs().sum() > 0
    assert rel_diff(g4, g1) <= 1e-6


def test_local_denominators_would_break_invariance():
    """Guard the test itself: dividing by per-micro-batch counts (verl's approximation) changes the gradient."""
    logp, old, adv, mask = minibatch(0)
    logp.requires_grad_(True)
    totals = loss_denominators(mask)
    (g1,) = torch.autograd.grad(split_loss(logp, old, adv, mask, [torch.arange(16)], "token-mean", totals), logp)
    approx = logp.new_zeros(())
    for idx in torch.arange(16).chunk(4):
        tok, seq = loss_denominators(mask[idx])
        loss, _ = policy_loss(logp[idx], old[idx], adv[idx], mask[idx], clip_low=0.2, clip_high=0.28,
                              global_tokens=tok, global_seqs=seq)
        approx = approx + loss / 4
    (g4,) = torch.autograd.grad(approx, logp)
    assert rel_diff(g4, g1) > 1e-3
