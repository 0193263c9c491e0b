"""GSPO, CISPO and RLOO through the Megatron actor's real loss path (tests/dist_scripts/objectives_actor.py).

One update on the same samples from the same HF weights: the gradient the optimizer sees is the same for 1, 2 or 3
micro-batches and at DP=2 (1 or 2 micro-batches per rank); at PP=2 in the packed layout the update's loss, clip
fractions and gradient norm are the same; the update's loss equals a naive float64 per-response loop
on the actor's own log-probs; and the gradient's norm equals that of the naive loop differentiated through Hugging
Face's own model (float64) on the same weights.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests import test_algo_loss, test_algo_objectives
from tests.dist_scripts.harness import HERE, TEMPERATURE, _launch, _wait, _write_workspace

pytestmark = pytest.mark.distributed

VARIANTS = ("gspo", "cispo", "rloo", "tools")
CLIPS = {"gspo": (0.05, 0.05), "cispo": (1.0, 0.2), "rloo": (0.2, 0.28), "tools": (0.2, 0.28)}


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory(prefix="dapo_objectives_") as tmp:
        ws = Path(tmp)
        spec = _write_workspace(ws)
        script = str(HERE / "objectives_actor.py")
        one = _launch([script, str(ws), "one", "1,2,3"])
        _wait(one, "objectives actor, DP=1")
        two = _launch([script, str(ws), "two", "1,2"], nproc=2)
        _wait(two, "objectives actor, DP=2")
        pp = _launch([script, str(ws), "pp", "1,2", "2", "packed"], nproc=2)
        _wait(pp, "objectives actor, PP=2 packed")
        yield {"ws": ws, "spec": spec, "one": torch.load(ws / "out" / "one_rank0.pt", weights_only=False),
               "two": [torch.load(ws / "out" / f"two_rank{r}.pt", weights_only=False) for r in range(2)],
               "pp": [torch.load(ws / "out" / f"pp_rank{r}.pt", weights_only=False) for r in range(2)],
               "hf": _hf_grad_norms(ws, spec)}


def _padded(spec: dict, logps: list[torch.Tensor], variant: str):
    import tests.dist_scripts.objectives_actor as script

    batch = script.with_tool_spans(spec["update1"]) if variant == "tools" else spec["update1"]
    width = max(len(s["response"]) for s in batch)
    old = torch.zeros(len(batch), width, dtype=torch.float64)
    mask = torch.zeros(len(batch), width, dtype=torch.float64)
    for i, s in enumerate(batch):
        n = len(s["response"])
        old[i, :n] = torch.tensor(s["old_logprobs"], dtype=torch.float64)
        mask[i, :n] = torch.tensor(s.get("loss_mask", [1.0] * n), dtype=torch.float64)
    rows = [torch.nn.functional.pad(lp.double(), (0, width - lp.numel())) for lp in logps]
    return torch.stack(rows), old, mask


def naive_loss(variant: str, logp, old, adv, mask):
    lo, hi = CLIPS[variant]
    if variant == "rloo":  # ppo_clip on leave-one-out advantages
        return test_algo_loss.naive(logp, old, adv, mask, lo, hi, None, "token-mean", 1)[0]
    if variant == "tools":  # a loop over the model's tokens only; bypass: token IS min(pi_theta / pi_engine, cap)
        import tests.dist_scripts.objectives_actor as script

        tis = torch.exp(logp.detach() - old).clamp(max=script.TIS_CAP)
        return test_algo_loss.naive(logp, old, adv, mask, lo, hi, None, "token-mean", 1, tis=tis)[0]
    agg = "seq-mean-token-mean" if variant == "gspo" else "token-mean"
    return test_algo_objectives.naive(variant, logp, old, adv, mask, lo, hi, agg)[0]


def _hf_grad_norms(ws: Path, spec: dict) -> dict[str, float]:
    """The naive loss differentiated through Hugging Face's model (float64) at the update's starting weights."""
    import transformers

    import tests.dist_scripts.objectives_actor as script
    from dapo_mcore.algo.advantages import group_advantages

    hf = transformers.AutoModelForCausalLM.from_pretrained(ws / "hf", dtype=torch.float64)
    out = {}
    for variant in VARIANTS:
        hf.zero_grad()
        logps = []
        for s in spec["update1"]:
            logits = hf(torch.tensor([s["prompt"] + s["response"]])).logits[0] / TEMPERATURE
            rows = torch.log_softmax(logits[len(s["prompt"]) - 1: len(s["prompt"]) - 1 + len(s["response"])], -1)
            logps.append(rows.gather(-1, torch.tensor(s["response"]).unsqueeze(-1)).squeeze(-1))
        logp, old, mask = _padded(spec, logps, variant)
        estimator = script.VARIANTS[variant][1]
        adv = group_advantages(torch.tensor(script.REWARDS, dtype=torch.float64), norm_by_std=estimator == "grpo",
                               estimator=estimator).reshape(-1)
        naive_loss(variant, logp, old, adv, mask).backward()
        out[variant] = float(torch.sqrt(sum(p.grad.pow(2).sum() for p in hf.parameters() if p.grad is not None)))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_is_split_invariant(runs, variant):
    ref = runs["one"][(variant, 1)]
    assert ref["metrics"]["update_ok"] == 1.0 and ref["grad"].norm() > 0
    for key, res in [(("one", 2), runs["one"][(variant, 2)]), (("one", 3), runs["one"][(variant, 3)])] + [
            (("two", r, n), runs["two"][r][(variant, n)]) for r in range(2) for n in (1, 2)]:
        assert _rel(res["grad"], ref["grad"]) <= 1e-5, (variant, key)
        for m in ("loss", "clipfrac", "clipfrac_high", "ppo_kl", "grad_norm"):
            assert res["metrics"][m] == pytest.approx(ref["metrics"][m], rel=1e-5, abs=1e-7), (variant, key, m)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pipeline_parallel_packed_update_matches(runs, variant):
    """PP=2 with packed micro-batches: each stage holds half the model, so the per-rank gradients are not the whole
    vector; the update's loss, clip fractions and (PP-reduced) gradient norm must match the single-process update."""
    ref = runs["one"][(variant, 1)]["metrics"]
    for r in range(2):
        for n in (1, 2):
            got = runs["pp"][r][(variant, n)]["metrics"]
            for m in ("loss", "clipfrac", "clipfrac_high", "ppo_kl", "grad_norm"):
                assert got[m] == pytest.approx(ref[m], rel=1e-5, abs=1e-7), (variant, r, n, m)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_equals_the_naive_loop_on_the_actors_logprobs(runs, variant):
    res = runs["one"][(variant, 1)]
    logp, old, mask = _padded(runs["spec"], res["logp"], variant)
    ref = naive_loss(variant, logp, old, torch.tensor(res["adv"], dtype=torch.float64), mask)
    assert res["metrics"]["loss"] == pytest.approx(float(ref), rel=1e-5, abs=1e-7)
    assert 0 < res["metrics"]["clipfrac"] < 1  # the clip binds on part of the batch


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_norm_equals_the_naive_loop_through_hugging_face(runs, variant):
    got = runs["one"][(variant, 1)]
    assert float(got["grad"].norm()) == pytest.approx(runs["hf"][variant], rel=1e-4)
    assert got["metrics"]["grad_norm"] == pytest.approx(runs["hf"][variant], rel=1e-4)


def test_the_objectives_give_different_gradients(runs):
    """Guard: the variants do not collapse into one (each objective reached the loss)."""
    grads = [runs["one"][(v, 1)]["grad"] for v in VARIANTS]
    assert min(_rel(grads[i], grads[j]) for i in range(4) for j in range(i + 1, 4)) > 1e-2
