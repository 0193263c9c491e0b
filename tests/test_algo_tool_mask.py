"""Tool-output tokens count nowhere: the masked policy loss of a multi-turn batch equals a naive loop over the
model's own tokens (value and gradient), equals the loss of the same rows with the tool spans cut out, is
split-invariant, and NaN engine log-probs on tool tokens (bypass mode's old log-probs, TIS) never leak in."""

from __future__ import annotations

import pytest
import torch

from dapo_mcore.algo.loss import loss_denominators, masked_entropy_contrib, policy_loss
from dapo_mcore.algo.rollout_correction import RolloutCorrectionConfig, correction
from dapo_mcore.rollout.correction.mismatch import MismatchStats
from tests.test_algo_loss import naive

pytestmark = pytest.mark.unit

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LEN = 20


def tool_batch(seed: int, b: int = 8, t: int = MAX_LEN):
    """Rows of model tokens with 0-2 tool-output spans each (mask 0 there), right padding, one all-tool row.
    ``old`` (and a TIS weight) is NaN on every tool token, as the engine reports it."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.randint(4, t + 1, (b,), generator=g)
    real = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    tool = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            start = int(torch.randint(1, max(int(lengths[i]) - 2, 2), (1,), generator=g))
            tool[i, start:start + int(torch.randint(1, 4, (1,), generator=g))] = True
    tool[5, :] = True  # a response that is all tool output (as far as the loss goes): empty
    tool &= real
    assert tool.any(dim=1).sum() >= 3
    mask = (real & ~tool).to(torch.float64)
    old = old.masked_fill(tool, float("nan"))
    tis = (0.5 + torch.rand(b, t, generator=g, dtype=torch.float64)).masked_fill(tool, float("nan"))
    return logp, old, adv, mask, tool, tis


def compacted(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row with its masked-out tokens deleted (tool spans cut), re-padded to the same width with zeros."""
    rows = [x[i][mask[i] > 0] for i in range(x.shape[0])]
    return torch.stack([torch.cat([r, x.new_zeros(x.shape[1] - r.numel())]) for r in rows])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_masked_loss_equals_naive_loop_over_model_tokens(mode, seed):
    logp, old, adv, mask, tool, tis = tool_batch(seed)
    tokens, seqs = loss_denominators(mask)
    assert tokens == int((~tool & (mask > 0)).sum()) and seqs == 7  # the all-tool row is no sequence
    for weights in (None, tis):
        loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, agg=mode,
                              global_tokens=tokens, global_seqs=seqs, max_response_len=MAX_LEN, tis_weights=weights)
        (grad,) = torch.autograd.grad(loss, logp)
        ref, ref_m = naive(logp, old, adv, mask, 0.2, 0.28, 3.0, mode, MAX_LEN, tis=weights)
        (ref_grad,) = torch.autograd.grad(ref, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert torch.allclose(loss, ref.detach(), rtol=1e-12, atol=1e-12)
        assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
        assert grad[tool].abs().max() == 0  # no gradient reaches a tool token
        for k, v in ref_m.items():
            assert m[k].item() == pytest.approx(v, abs=1e-12), k
        if weights is not None:
            assert torch.isfinite(m["tis_weight"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "cispo"])
def test_masked_loss_equals_loss_with_tool_spans_cut_out(mode, objective):
    """The whole point: a row with tool output behaves as if the tool's tokens were not there."""
    logp, old, adv, mask, _, _ = tool_batch(3)
    tokens, seqs = loss_denominators(mask)
    dual = 3.0 if objective == "ppo_clip" else None
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=dual, agg=mode, global_tokens=tokens, global_seqs=seqs,
              max_response_len=MAX_LEN, objective=objective)
    loss, m = policy_loss(logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    cut_logp = compacted(logp, mask)
    cut_mask = compacted(mask, mask)
    cut_old = compacted(old, mask)
    assert loss_denominators(cut_mask) == (tokens, seqs)
    cut_loss, cut_m = policy_loss(cut_logp, cut_old, adv, cut_mask, **kw)
    (cut_grad,) = torch.autograd.grad(cut_loss, logp)
    assert torch.allclose(loss, cut_loss, rtol=1e-12, atol=1e-14)
    assert torch.allclose(grad, cut_grad, rtol=1e-10, atol=1e-14)
    for k in m:
        assert m[k].item() == pytest.approx(cut_m[k].item(), abs=1e-12), k


@pytest.mark.parametrize("mode", MODES)
def test_masked_loss_is_split_invariant(mode):
    logp, old, adv, mask, _, tis = tool_batch(4, b=16)
    totals = loss_denominators(mask)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, agg=mode, global_tokens=totals[0],
              global_seqs=totals[1], max_response_len=MAX_LEN)
    whole, _ = policy_loss(logp, old, adv, mask, tis_weights=tis, **kw)
    (g1,) = torch.autograd.grad(whole, logp)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(11))
    micro = [perm[i * 4:(i + 1) * 4] for i in range(4)]
    assert tuple(map(sum, zip(*(loss_denominators(mask[i]) for i in micro), strict=True))) == totals
    split = sum(policy_loss(logp[i], old[i], adv[i], mask[i], tis_weights=tis[i], **kw)[0] for i in micro)
    (g4,) = torch.autograd.grad(split, logp)
    assert abs(split.item() - whole.item()) <= 1e-12 * max(1.0, abs(whole.item()))
    assert g1.abs().sum() > 0
    assert torch.allclose(g1, g4, rtol=1e-10, atol=1e-14)


def test_entropy_mismatch_and_correction_skip_tool_tokens():
    logp, old, _, mask, tool, _ = tool_batch(5)
    tokens, _ = loss_denominators(mask)
    ent = torch.rand(mask.shape, dtype=torch.float64) + 1.0
    ent_ref = sum(float(ent[i, j]) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]) / tokens
    assert masked_entropy_contrib(ent, mask, tokens).item() == pytest.approx(ent_ref, rel=1e-12)
    engine = old  # NaN on tool tokens
    actor = logp.detach()
    stats = MismatchStats.from_tensors(engine, actor, mask.bool(), tis_cap=2.0).metrics()
    assert stats["mismatch/tokens"] == tokens
    assert all(v == v for v in stats.values())  # no NaN
    d = [float(engine[i, j] - actor[i, j]) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    assert stats["mismatch/kl_k1"] == pytest.approx(sum(d) / len(d), rel=1e-12)
    for cfg in (RolloutCorrectionConfig(is_level="sequence", is_threshold=2.0),
                RolloutCorrectionConfig(is_level="token", is_threshold=2.0, rs="token_k1", rs_thresholds=(0.5, 2.0))):
        w, keep, metrics = correction(actor - engine, mask, cfg)
        assert torch.isfinite(w).all() and torch.isfinite(keep.double()).all()
        assert all(v == v for v in metrics.values())
        assert (w[tool] == 0).all()
