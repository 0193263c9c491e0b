"""GSPO, CISPO and RLOO against naive per-response float64 loops (value, gradient, metrics), and their refusals."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_mcore.algo import advantages as adv_mod
from dapo_mcore.algo import config as algo_config
from dapo_mcore.algo import loss as loss_mod
from dapo_mcore.algo.advantages import group_advantages
from dapo_mcore.algo.config import AlgoConfig
from dapo_mcore.algo.loss import loss_denominators, policy_loss

pytestmark = pytest.mark.unit

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LEN = 13
CLIPS = {"gspo": (3e-2, 4e-2), "cispo": (1.0, 0.3)}  # gspo: wide enough that some sequences clip, some not


def make_batch(seed: int, b: int = 9, t: int = 10):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.15 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    adv[0] = 0.0
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[2] = 0
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    tis = torch.rand(b, t, generator=g, dtype=torch.float64) * 1.5 + 0.25
    keep = torch.rand(b, t, generator=g) > 0.2
    return logp, old, adv, mask, tis, keep


def aggregate(seq_sums, seq_lens, agg):
    tokens, seqs = sum(seq_lens), sum(1 for n in seq_lens if n > 0)
    if agg == "token-mean":
        return sum(seq_sums) / tokens
    if agg == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(seq_sums, seq_lens, strict=True) if n > 0) / seqs
    if agg == "seq-mean-token-sum":
        return sum(seq_sums) / seqs
    return sum(seq_sums) / (MAX_LEN * seqs)


def naive(objective, logp, old, adv, mask, lo, hi, agg, tis=None):
    """Loop over responses and tokens, branches in Python floats: (loss, clipped tokens, low, high, tokens).

    gspo: each token's loss has the value max(-A s, -A clip(s)) of its sequence and the gradient -A s d(logp_t)
    when the unclipped branch holds, 0 when the clip binds (built as value + g * (logp_t - value of logp_t)).
    cispo: -clip(r_t) * A * logp_t with clip(r_t) a float (no gradient through the weight)."""
    b, t = mask.shape
    lp = logp.detach()  # Python floats for the branches; the gradient flows through logp only where written
    seq_sums, seq_lens, clip = [], [], {"all": 0, "low": 0, "high": 0}
    for i in range(b):
        a, toks = float(adv[i]), [j for j in range(t) if mask[i, j] > 0]
        if objective == "gspo" and toks:
            s = math.exp(sum(float(lp[i, j] - old[i, j]) for j in toks) / len(toks))
            unclipped, clipped = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
            seq_clipped = clipped > unclipped
            value, slope = (clipped, 0.0) if seq_clipped else (unclipped, -a * s)
        total = logp.new_zeros(())
        for j in toks:
            if objective == "gspo":
                tok = value + slope * (logp[i, j] - float(lp[i, j]))
                hit, above = seq_clipped, s > 1
            else:
                r = math.exp(float(lp[i, j] - old[i, j]))
                w = min(max(r, 1 - lo), 1 + hi)
                tok = -w * a * logp[i, j]
                hit, above = w != r, r > 1
            if hit:
                clip["all"] += 1
                clip["high" if above else "low"] += 1
            total = total + tok * (float(tis[i, j]) if tis is not None else 1.0)
        seq_sums.append(total)
        seq_lens.append(len(toks))
    return aggregate(seq_sums, seq_lens, agg), clip, sum(seq_lens)


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_objective_matches_naive_reference(objective, mode, seed):
    logp, old, adv, mask, _, _ = make_batch(seed)
    lo, hi = CLIPS[objective]
    tokens, seqs = loss_denominators(mask)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi, agg=mode, global_tokens=tokens,
                          global_seqs=seqs, max_response_len=MAX_LEN, objective=objective)
    (grad,) = torch.autograd.grad(loss, logp)
    ref, clip, n = naive(objective, logp, old, adv, mask, lo, hi, mode)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert grad[mask == 0].abs().max() == 0
    assert 0 < clip["all"] < n  # the clip binds on some tokens, not all
    assert m["clipfrac"].item() == pytest.approx(clip["all"] / n, abs=1e-14)
    assert m["clipfrac_low"].item() == pytest.approx(clip["low"] / n, abs=1e-14)
    assert m["clipfrac_high"].item() == pytest.approx(clip["high"] / n, abs=1e-14)
    assert m["dual_clipfrac"].item() == 0.0


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_correction_weights_and_rejection_compose(objective):
    """tis_weights multiply the token loss; keep removes tokens from the loss, GSPO's sequence ratio and metrics."""
    logp, old, adv, mask, tis, keep = make_batch(4)
    lo, hi = CLIPS[objective]
    kept = mask * keep
    tokens, seqs = loss_denominators(kept)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi, agg="token-mean", global_tokens=tokens,
                          global_seqs=seqs, tis_weights=tis, keep=keep, objective=objective)
    ref, clip, n = naive(objective, logp, old, adv, kept, lo, hi, "token-mean", tis=tis)
    assert n == tokens < int(mask.sum())
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0],
                               rtol=1e-10, atol=1e-14)
    assert m["clipfrac"].item() == pytest.approx(clip["all"] / n, abs=1e-14)
    assert m["tis_weight"].item() == pytest.approx(float((tis * kept).sum()) / tokens, rel=1e-12)


def test_gspo_seq_mean_is_the_sequence_objective():
    """With seq-mean-token-mean the token form is GSPO's objective -mean_i min(s_i A_i, clip(s_i) A_i), s_i carrying
    its full gradient: the same value and gradient."""
    logp, old, adv, mask, _, _ = make_batch(2)
    lo, hi = CLIPS["gspo"]
    tokens, seqs = loss_denominators(mask)
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi, agg="seq-mean-token-mean",
                          global_tokens=tokens, global_seqs=seqs, objective="gspo")
    terms = []
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        if n:
            s = torch.exp((logp[i, :n] - old[i, :n]).sum() / n)
            terms.append(-torch.minimum(s * adv[i], s.clamp(1 - lo, 1 + hi) * adv[i]))
    ref = sum(terms) / len(terms)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0],
                               rtol=1e-10, atol=1e-14)


def test_cispo_never_drops_a_token_where_ppo_clip_does():
    """A token whose ratio is far past the clip: PPO's gradient there is 0, CISPO's is -clip(r) * A."""
    logp = torch.log(torch.tensor([[3.0, 1.0]], dtype=torch.float64)).requires_grad_(True)
    old, mask, adv = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), torch.ones(1)
    kw = dict(clip_low=0.2, clip_high=0.28, global_tokens=2, global_seqs=1)
    (g_ppo,) = torch.autograd.grad(policy_loss(logp, old, adv, mask, **kw)[0], logp)
    cispo, m = policy_loss(logp, old, adv, mask, objective="cispo", **kw)
    (g_cispo,) = torch.autograd.grad(cispo, logp)
    assert g_ppo[0, 0] == 0.0 and g_cispo[0, 0].item() == pytest.approx(-1.28 / 2)
    assert g_cispo[0, 1].item() == pytest.approx(-1.0 / 2)
    assert m["clipfrac"].item() == pytest.approx(0.5) and m["clipfrac_high"].item() == pytest.approx(0.5)


def test_gspo_clips_whole_sequences():
    """One sequence's mean log-ratio past 1 + eps_high clips every one of its tokens (clipfrac counts them all)."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.3, -0.1, 0.1], [0.0, 0.0, 0.0]], dtype=torch.float64).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, m = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask, clip_low=3e-4, clip_high=4e-4,
                          agg="seq-mean-token-mean", global_tokens=5, global_seqs=2, objective="gspo")
    (grad,) = torch.autograd.grad(loss, logp)
    assert m["clipfrac"].item() == pytest.approx(3 / 5) and m["clipfrac_high"].item() == pytest.approx(3 / 5)
    assert grad[0].abs().max() == 0 and grad[1, :2].tolist() == pytest.approx([-0.25, -0.25])
    assert loss.item() == pytest.approx(-(1 + 4e-4 + 1.0) / 2)


def test_ppo_clip_is_unchanged_by_the_objective_argument():
    logp, old, adv, mask, tis, keep = make_batch(5)
    tokens, seqs = loss_denominators(mask * keep)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=2.0, global_tokens=tokens, global_seqs=seqs, tis_weights=tis,
              keep=keep)
    a, ma = policy_loss(logp, old, adv, mask, **kw)
    b, mb = policy_loss(logp, old, adv, mask, objective="ppo_clip", **kw)
    assert a.item() == b.item() and all(ma[k].item() == mb[k].item() for k in ma)


def test_objective_errors():
    logp, old, adv, mask, _, _ = make_batch(0)
    with pytest.raises(ValueError, match="valid: ppo_clip, gspo, cispo"):
        policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, global_tokens=5, global_seqs=2,
                    objective="grpo")
    with pytest.raises(ValueError, match="dual_clip_c=3.0 belongs to the ppo_clip objective"):
        policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0, global_tokens=5,
                    global_seqs=2, objective="gspo")


# ---------------------------------------------------------------- RLOO
def test_rloo_matches_a_leave_one_out_loop():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(5, 6, generator=g)
    got = group_advantages(rewards, norm_by_std=False, estimator="rloo")
    for k in range(5):
        for i in range(6):
            others = [float(rewards[k, j]) for j in range(6) if j != i]
            assert got[k, i].item() == pytest.approx(float(rewards[k, i]) - sum(others) / 5, rel=1e-6, abs=1e-7)
    assert got.dtype == torch.float32
    # G/(G-1) times the group-centred reward: a constant group (what dynamic sampling drops) gets 0
    torch.testing.assert_close(got, group_advantages(rewards, norm_by_std=False) * 6 / 5, rtol=1e-6, atol=1e-6)
    assert group_advantages(torch.ones(2, 4), norm_by_std=False, estimator="rloo").abs().max() == 0


def test_rloo_refusals():
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        group_advantages(torch.ones(3, 1), norm_by_std=False, estimator="rloo")
    with pytest.raises(ValueError, match="norm_adv_by_std=false"):
        group_advantages(torch.ones(3, 4), estimator="rloo")
    with pytest.raises(ValueError, match="valid: grpo, rloo"):
        group_advantages(torch.ones(3, 4), estimator="gae")


# ---------------------------------------------------------------- config
def test_names_agree_with_the_torch_side():
    assert algo_config.OBJECTIVES == loss_mod.OBJECTIVES
    assert algo_config.ADVANTAGE_ESTIMATORS == adv_mod.ESTIMATORS


def test_presets():
    gspo = AlgoConfig.from_preset("gspo")
    assert (gspo.objective, gspo.clip_low, gspo.clip_high, gspo.loss_agg) == (
        "gspo", 3e-4, 4e-4, "seq-mean-token-mean")
    cispo = AlgoConfig.from_preset("cispo")
    assert (cispo.objective, cispo.clip_low, cispo.clip_high, cispo.loss_agg) == ("cispo", 1.0, 4.0, "token-mean")
    assert gspo.dynamic_sampling and cispo.dynamic_sampling  # composes with DAPO's dynamic sampling


@pytest.mark.parametrize("bad,match", [
    ({"objective": "grpo"}, "algo.objective='grpo' is unknown; valid: ppo_clip, gspo, cispo"),
    ({"advantage_estimator": "gae"}, "valid: grpo, rloo"),
    ({"advantage_estimator": "rloo"}, "set algo.norm_adv_by_std=false"),
    ({"objective": "gspo", "dual_clip_c": 3.0}, "algo.dual_clip_c=null"),
    ({"clip_low": 1.0}, "cispo: \\(0, 1\\]"),
])
def test_config_refusals(bad, match):
    with pytest.raises(ValueError, match=match):
        AlgoConfig.from_preset("dapo", **bad)
    AlgoConfig.from_preset("dapo", advantage_estimator="rloo", norm_adv_by_std=False)  # the valid form


# ---------------------------------------------------------------- the run config
@pytest.mark.parametrize("overrides,needle", [
    (["algo.advantage_estimator=rloo"], "set algo.norm_adv_by_std=false"),
    (["algo.advantage_estimator=rloo", "algo.norm_adv_by_std=false", "rollout.n=1", "algo.dynamic_sampling=false"],
     "rollout.n=1: algo.advantage_estimator=rloo compares each response with the other responses"),
    (["algo.objective=gspo", "algo.dual_clip_c=3"], "algo.dual_clip_c=null"),
    (["algo.objective=ppo"], "valid: ppo_clip, gspo, cispo"),
])
def test_run_config_refusals_are_one_line(overrides, needle):
    from pathlib import Path

    from dapo_mcore.config import ConfigError, load_config

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(tiny, overrides).validate(1)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_run_config_takes_the_objectives_with_dynamic_sampling_and_a_correction():
    from pathlib import Path

    from dapo_mcore.config import load_config

    chain = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu_chain.yaml"
    for extra in (["algo.objective=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4"],
                  ["algo.objective=cispo", "algo.clip_low=1.0", "algo.clip_high=4.0"],
                  ["algo.advantage_estimator=rloo", "algo.norm_adv_by_std=false"]):
        cfg = load_config(chain, [*extra, "algo.rollout_correction.preset=seq_mis"])
        cfg.validate(1)
        assert cfg.algo.dynamic_sampling and cfg.algo.correction.active


def test_the_trainer_computes_the_configured_estimator():
    """Trainer.make_samples: rloo's leave-one-out advantages reach the samples (grpo's would differ)."""
    from types import SimpleNamespace

    from dapo_mcore.trainer import Trainer

    rewards = [1.0, -1.0, -1.0, 1.0, 1.0]
    resp = [SimpleNamespace(length=2, finish_reason="stop", token_ids=[5, 6], logprobs=[-0.1, -0.2], stale_tokens=0,
                            versions=None, routed_experts=None, loss_mask=None) for _ in rewards]
    group = SimpleNamespace(rewards=rewards, responses=resp, prompt_ids=[3])
    cfg = SimpleNamespace(algo=AlgoConfig(advantage_estimator="rloo", norm_adv_by_std=False))
    got = [s.advantage for s in Trainer.make_samples(SimpleNamespace(cfg=cfg), [group])]
    want = [r - (sum(rewards) - r) / 4 for r in rewards]
    assert got == pytest.approx(want, rel=1e-6)
