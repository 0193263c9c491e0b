"""Exact resume after kill -9, and checkpoints that do not fit refused before any parameter changes.

A process runs k=2 DAPO steps, checkpoints, runs step 3 and is SIGKILLed inside the save of step 3 (model and
optimizer files written, COMPLETE not). A new process resumes from find_latest and runs to N=4. Its per-step
losses, grad norms and final weights must equal those of an uninterrupted run exactly. The runs are shared with
the other distributed tests (tests/dist_scripts/harness.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_scripts.harness import run_all

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs():
    return run_all()


def test_kill_during_save_leaves_a_partial_checkpoint_that_is_skipped(runs):
    from dapo_mcore.actor.checkpoint import find_latest

    k = runs["spec"]["resume_k"]
    assert runs["ckpt_entries_after_kill"] == ["latest", f"step_{k:06d}", f"step_{k + 1:06d}.partial"]
    assert runs["resume"]["found"] == f"step_{k:06d}"
    assert runs["resume"]["state"] == {"step": k}
    n = runs["spec"]["resume_steps"]
    assert runs["resume"]["entries_after_next_save"] == ["latest", f"step_{n:06d}"]  # keep_last=1, partial gone
    assert find_latest(runs["ws"] / "ckpt").name == f"step_{n:06d}"


def test_resumed_run_equals_the_straight_run_exactly(runs):
    k, n = runs["spec"]["resume_k"], runs["spec"]["resume_steps"]
    straight, killed, resumed = runs["straight_log"], runs["killed_log"], runs["resume_log"]
    assert [e["step"] for e in straight] == list(range(1, n + 1))
    assert [e["step"] for e in killed] == list(range(1, k + 2))   # it died while saving step k+1
    assert [e["step"] for e in resumed] == list(range(k + 1, n + 1))
    assert killed == straight[: k + 1]
    assert resumed == straight[k:], "per-step losses / grad norms differ after resume"
    final, want = runs["resume"]["weights"], runs["straight_weights"]
    assert sorted(final) == sorted(want)
    assert all(torch.equal(final[name], want[name]) for name in want), max(
        (final[name] - want[name]).abs().max().item() for name in want)


def test_resume_is_sensitive_to_the_restored_state(runs):
    """Guard: the steps differ from each other, so replaying the wrong step or RNG state would be caught."""
    losses = [tuple(e["loss"]) for e in runs["straight_log"]]
    assert len(set(losses)) == len(losses)


@pytest.mark.parametrize("name, needle", [
    ("ffn", "ffn_hidden_size: checkpoint 176, live model 96"),
    ("layers", "num_layers: checkpoint 2, live model 4"),
    ("vocab", "vocab_size: checkpoint 37, live model 45"),  # same padded shape (48 rows): shapes alone miss it
])
def test_checkpoint_of_another_model_shape_is_refused_untouched(runs, name, needle):
    result = runs["resume"]["mismatch"][name]
    assert result["error"] is not None and result["error"].startswith("CheckpointError"), result
    assert needle in result["error"], result["error"]
    assert result["untouched"] is True


@pytest.mark.parametrize("layout, needle", [("tp2_pp1_dp1", "tp: checkpoint 1, live model 2"),
                                            ("tp1_pp2_dp1", "pp: checkpoint 1, live model 2")])
def test_checkpoint_of_another_layout_is_refused_untouched(runs, layout, needle):
    for rank in range(2):
        result = runs["multi"][rank][layout]["mismatch"]
        assert result["error"] is not None and needle in result["error"], result
        assert result["untouched"] is True
