"""Exact resume after kill -9, elastic resume at other layouts, and checkpoints of other models refused untouched.

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


@pytest.mark.parametrize("layout", ["tp2_pp1_dp1", "tp1_pp2_dp1", "tp1_pp1_dp2"])
def test_checkpoint_of_another_layout_loads_resharded_exactly(runs, layout, tmp_path):
    """The TP=1 checkpoint loaded at TP=2 / PP=2 / DP=2 holds exactly its weights (checked against the offline
    converter)."""
    from safetensors.torch import load_file

    from conversion.mcore_to_hf import convert_mcore_to_hf

    hf_dir = convert_mcore_to_hf(runs["ws"] / "ckpt_tp1", tmp_path / "hf")
    want = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    for rank in range(2):
        got = runs["multi"][rank][layout]["elastic"]
        assert got["state"] == {"step": runs["spec"]["resume_k"]}
        assert sorted(got["weights"]) == sorted(want)
        assert all(torch.equal(got["weights"][k], want[k]) for k in want), layout


def test_elastic_resume_tp1_to_tp2_to_pp2_follows_the_straight_run(runs):
    """Step k at TP=1 -> step k+1 at TP=2 -> steps k+2..N at PP=2, with Adam's state resharded each time.

    Other layouts sum in another order, so the match is within float tolerance, not bitwise; a fresh optimizer
    (moments lost) or a wrong step count would move the second update's loss and the weights far more."""
    k, n = runs["spec"]["resume_k"], runs["spec"]["resume_steps"]
    elastic, straight = runs["elastic_log"], runs["straight_log"][k:]
    assert [e["step"] for e in elastic] == list(range(k + 1, n + 1))
    for got, want in zip(elastic, straight, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4, abs=1e-6), got["step"]
    final, ref = runs["elastic"]["weights"], runs["straight_weights"]
    assert sorted(final) == sorted(ref)
    worst = max((final[name] - ref[name]).abs().max().item() for name in ref)
    assert worst < 1e-5, worst
    fresh = runs["elastic"]["fresh_optimizer_weights"]  # the same steps with Adam's state dropped
    assert max((fresh[name] - ref[name]).abs().max().item() for name in ref) > 100 * max(worst, 1e-7)
    moved = max((runs["resume"]["weights"][name] - runs["straight_weights"][name]).abs().max().item() for name in ref)
    assert moved == 0.0  # the same-layout resume stays bit-exact


def test_bf16_optimizer_state_with_fp32_main_params_round_trips_exactly(tmp_path):
    from tests.dist_scripts.harness import HERE, _launch, _wait, _write_workspace

    ws = tmp_path / "ws"
    _write_workspace(ws)
    _wait(_launch([str(HERE / "actor_resume.py"), str(ws), "bf16"]), "bf16 save/load")
    out = torch.load(ws / "out" / "bf16.pt", weights_only=False)
    assert out["kinds"] == ["exp_avg", "exp_avg_sq", "main_params", "optimizer.json"]
    saved, loaded = out["saved"], out["loaded"]
    assert sorted(saved) == sorted(loaded)
    for key in saved:
        assert saved[key]["dtype"] == "torch.float32" and saved[key]["step"] == loaded[key]["step"] == 2.0  # two updates
        for field in ("main", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[key][field], loaded[key][field]), (key, field)
    assert out["next_a"] == out["next_b"]
