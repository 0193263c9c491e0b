"""DAPO policy loss vs a naive loop-over-tokens reference, on random inputs, for every aggregation mode."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_mcore.algo.loss import (
    get_loss_agg,
    loss_agg_names,
    loss_denominators,
    masked_entropy_contrib,
    policy_loss,
    register_loss_agg,
    token_entropy,
)

pytestmark = pytest.mark.unit

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LEN = 13


def make_batch(seed: int, b: int = 7, t: int = 9, empty_rows: tuple[int, ...] = (2,)):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    adv[0] = 0.0
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    for r in empty_rows:
        lengths[r] = 0
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return logp, old, adv, mask


def naive(logp, old, adv, mask, clip_low, clip_high, c, agg, max_len, tis=None):
    """Explicit loops; returns (loss as a differentiable scalar, metric floats)."""
    b, t = mask.shape
    seq_sums, seq_lens = [], []
    counts = {"clip": 0, "low": 0, "high": 0, "dual": 0}
    kl, tokens = 0.0, 0
    for i in range(b):
        s, n = logp.new_zeros(()), 0
        a = float(adv[i])
        for j in range(t):
            if mask[i, j] == 0:
                continue
            r = torch.exp(logp[i, j] - old[i, j])
            rf = float(r.detach())
            l1 = -a * r
            l2 = -a * r.clamp(1 - clip_low, 1 + clip_high)
            loss = l1 if float(l1.detach()) >= float(l2.detach()) else l2
            if float(l2.detach()) > float(l1.detach()):
                counts["clip"] += 1
                counts["low" if a < 0 else "high"] += 1
                assert (a < 0 and rf < 1 - clip_low) or (a > 0 and rf > 1 + clip_high)
            if c is not None and a < 0 and float(loss.detach()) > -a * c:
                loss = logp.new_tensor(-a * c)
                counts["dual"] += 1
            if tis is not None:
                loss = loss * float(tis[i, j])
            s = s + loss
            n += 1
            kl += float(old[i, j] - logp[i, j].detach())
        seq_sums.append(s)
        seq_lens.append(n)
        tokens += n
    seqs = sum(1 for n in seq_lens if n > 0)
    if agg == "token-mean":
        total = sum(seq_sums) / tokens
    elif agg == "seq-mean-token-mean":
        total = sum(s / n for s, n in zip(seq_sums, seq_lens, strict=True) if n > 0) / seqs
    elif agg == "seq-mean-token-sum":
        total = sum(seq_sums) / seqs
    else:
        total = sum(seq_sums) / (max_len * seqs)
    metrics = {"clipfrac": counts["clip"] / tokens, "clipfrac_low": counts["low"] / tokens,
               "clipfrac_high": counts["high"] / tokens, "dual_clipfrac": counts["dual"] / tokens,
               "ppo_kl": kl / tokens}
    return total, metrics


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dual", [None, 1.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_reference(mode, dual, seed):
    logp, old, adv, mask = make_batch(seed)
    tokens, seqs = loss_denominators(mask)
    loss, m = policy_loss(logp, old, adv.unsqueeze(1).expand_as(mask), mask, clip_low=0.2, clip_high=0.28,
                          dual_clip_c=dual, agg=mode, global_tokens=tokens, global_seqs=seqs,
                          max_response_len=MAX_LEN)
    (grad,) = torch.autograd.grad(loss, logp)
    ref, ref_m = naive(logp, old, adv, mask, 0.2, 0.28, dual, mode, MAX_LEN)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert torch.allclose(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert grad[mask == 0].abs().max() == 0  # padding and empty rows get no gradient
    for k, v in ref_m.items():
        assert m[k].item() == pytest.approx(v, abs=1e-12), k
    assert m["clipfrac"].item() == pytest.approx(m["clipfrac_low"].item() + m["clipfrac_high"].item())
    if dual is None:
        assert m["dual_clipfrac"].item() == 0.0


def test_clipping_actually_exercised():
    logp, old, adv, mask = make_batch(0, b=40, t=20)
    tokens, seqs = loss_denominators(mask)
    _, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=1.5,
                       global_tokens=tokens, global_seqs=seqs)
    assert m["clipfrac_low"] > 0 and m["clipfrac_high"] > 0 and m["dual_clipfrac"] > 0


def test_known_values_single_token():
    # A > 0, r = 2: clipped to 1.28 -> loss -1.28 A; A < 0, r = 0.5: clipped to 0.8 -> loss 0.8|A|
    logp = torch.log(torch.tensor([[2.0], [0.5], [5.0]], dtype=torch.float64))
    old = torch.zeros(3, 1, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(3, 1, dtype=torch.float64)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0,
                          global_tokens=3, global_seqs=3)
    # third: A=-1, r=5 -> max(5, 5)=5, dual clip caps at 3
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 3.0) / 3)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 3)
    assert m["clipfrac_low"].item() == pytest.approx(1 / 3)
    assert m["dual_clipfrac"].item() == pytest.approx(1 / 3)


def test_tis_weights_scale_token_loss():
    logp, old, adv, mask = make_batch(3)
    rollout = old + 0.3 * torch.randn_like(old)
    w = torch.exp(old - rollout).clamp(max=2.0)
    tokens, seqs = loss_denominators(mask)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, global_tokens=tokens,
                          global_seqs=seqs, tis_weights=w)
    ref, _ = naive(logp, old, adv, mask, 0.2, 0.28, None, "token-mean", MAX_LEN, tis=w)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert m["tis_weight"].item() == pytest.approx((w * mask).sum().item() / tokens)


def test_denominators_count_nonempty_rows():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert loss_denominators(mask) == (3, 2)


def test_all_empty_microbatch_contributes_zero():
    logp, old, adv, mask = make_batch(0)
    mask.zero_()
    for mode in MODES:
        loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg=mode, global_tokens=10,
                              global_seqs=3, max_response_len=MAX_LEN)
        assert loss.item() == 0.0 and m["clipfrac"].item() == 0.0
        assert torch.autograd.grad(loss, logp)[0].abs().max() == 0


def test_bad_denominators_and_mode_errors():
    logp, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="global_tokens"):
        policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, global_tokens=0, global_seqs=1)
    with pytest.raises(ValueError, match="max_response_len"):
        policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-sum-norm",
                    global_tokens=5, global_seqs=1)
    with pytest.raises(ValueError, match="valid: token-mean, seq-mean-token-mean"):
        get_loss_agg("sequence-mean")
    with pytest.raises(ValueError, match="already registered"):
        register_loss_agg("token-mean")(lambda *a, **k: None)
    assert loss_agg_names()[:4] == MODES


def test_entropy_helpers():
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    ent = token_entropy(logits)
    p = torch.softmax(logits, -1)
    assert torch.allclose(ent, -(p * p.log()).sum(-1).float())
    uniform = token_entropy(torch.zeros(1, 1, 8))
    assert uniform.item() == pytest.approx(math.log(8), rel=1e-6)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_entropy_contrib(ent, mask, 6).item() == pytest.approx(
        (ent[0, 0] + ent[0, 1] + ent[1, 0]).item() / 6, rel=1e-6)
