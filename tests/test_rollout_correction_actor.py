"""Bypass mode in the Megatron actor (tests/dist_scripts/bypass_actor.py): one update with the correction computed
inside the loss from pi_theta equals the decoupled update with the same correction computed up front, at DP=2
(rejection and batch normalization on: denominators and the mean are global over the DP ranks; the decoupled DP=2
update equals the single-process one: tests/test_actor_parity.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.dist_scripts.harness import HERE, _launch, _wait, _write_workspace

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory(prefix="dapo_bypass_") as tmp:
        ws = Path(tmp)
        _write_workspace(ws)
        script = str(HERE / "bypass_actor.py")
        two = _launch([script, str(ws), "two"], nproc=2)
        _wait(two, "bypass actor, DP=2")
        yield {name: [torch.load(ws / "out" / f"{name}_rank{r}.pt", weights_only=False) for r in range(n)]
               for name, n in (("two", 2),)}


def _max_weight_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_bypass_update_equals_the_decoupled_update(results):
    ref = results["two"][0]
    m = ref["bypass"]["metrics"]
    # rejection bit (some tokens, not all) and the weights were not all 1
    assert 0 < m["rollout_corr/rejected_token_frac"] < 1 and m["rollout_corr/is_weight_max"] != 1.0
    for key in ("rollout_corr/rejected_token_frac", "rollout_corr/ess", "rollout_corr/kl_k3"):
        assert m[key] == pytest.approx(ref["decoupled"]["correction"][key], rel=1e-4), key
    for key in ("loss", "clipfrac", "entropy", "grad_norm"):  # grad_norm: before clipping, so the scale shows
        assert m[key] == pytest.approx(ref["decoupled"]["metrics"][key], rel=1e-4, abs=1e-7), key
    for run in results["two"]:
        assert _max_weight_diff(run["bypass"]["weights"], ref["decoupled"]["weights"]) < 1e-5
        for key in ("loss", "grad_norm"):
            assert run["bypass"]["metrics"][key] == pytest.approx(m[key], rel=1e-4), key
    assert _max_weight_diff(ref["bypass"]["weights"], ref["bypass"]["initial"]) > 1e-4  # the update moved them
