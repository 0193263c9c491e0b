"""Training-inference mismatch metrics and truncated importance weights against naive loops."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_mcore.rollout import MismatchStats, mismatch_metrics, tis_weights

pytestmark = pytest.mark.unit


def make(seed: int, shape=(4, 9)):
    g = torch.Generator().manual_seed(seed)
    actor = -torch.rand(shape, generator=g) * 3
    engine = actor + 0.2 * torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3
    return engine, actor, mask


def naive(engine, actor, mask, cap):
    diffs, k3s, ws, clipped = [], [], [], 0
    for i in range(engine.shape[0]):
        for t in range(engine.shape[1]):
            if not mask[i, t]:
                continue
            d = engine[i, t].item() - actor[i, t].item()
            r = math.exp(-d)
            diffs.append(d)
            k3s.append(r - 1 - math.log(r))
            ws.append(min(r, cap))
            clipped += r > cap
    n = len(diffs)
    return {"mismatch/tokens": n, "mismatch/mean_abs_diff": sum(abs(d) for d in diffs) / n,
            "mismatch/max_abs_diff": max(abs(d) for d in diffs), "mismatch/kl_k1": sum(diffs) / n,
            "mismatch/kl_k3": sum(k3s) / n, "mismatch/tis_mean": sum(ws) / n, "mismatch/tis_clip_frac": clipped / n}


def test_metrics_match_naive_loop():
    engine, actor, mask = make(0)
    got = mismatch_metrics(engine, actor, mask, tis_cap=1.1)
    want = naive(engine, actor, mask, 1.1)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert 0 < got["mismatch/tis_clip_frac"] < 1 and got["mismatch/kl_k3"] >= 0


def test_merge_equals_one_batch():
    engine, actor, mask = make(1, (6, 7))
    whole = MismatchStats.from_tensors(engine, actor, mask, tis_cap=2.0).metrics()
    parts = MismatchStats()
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        parts = parts.merge(MismatchStats.from_tensors(engine[rows], actor[rows], mask[rows], tis_cap=2.0))
    for key, value in whole.items():
        assert parts.metrics()[key] == pytest.approx(value, rel=1e-9), key


def test_identical_logprobs_and_empty_mask():
    engine, _, mask = make(2)
    m = mismatch_metrics(engine, engine.clone(), mask)
    assert m["mismatch/max_abs_diff"] == 0 and m["mismatch/kl_k3"] == 0 and "mismatch/tis_mean" not in m
    empty = mismatch_metrics(engine, engine + 1, torch.zeros_like(mask))
    assert empty["mismatch/tokens"] == 0 and empty["mismatch/mean_abs_diff"] == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch_metrics(engine, engine[:, :3], mask)


def test_tis_weights():
    engine, actor, _ = make(3)
    actor.requires_grad_(True)
    w = tis_weights(actor, engine, cap=1.2)
    assert not w.requires_grad and w.shape == actor.shape
    for i in range(actor.shape[0]):
        for t in range(actor.shape[1]):
            want = min(math.exp(actor[i, t].item() - engine[i, t].item()), 1.2)
            assert w[i, t].item() == pytest.approx(want, rel=1e-6)
    assert (w <= 1.2).all() and (w < 1.2).any()
    with pytest.raises(ValueError, match="cap"):
        tis_weights(actor, engine, cap=0.0)
