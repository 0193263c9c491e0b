"""End-to-end through the CLI: damaged checkpoints fall back or stop with one line; a full disk is one line too.

Shares the tiny-run setup (and base-model cache) of test_e2e_tiny.py. The full-disk test mounts a small tmpfs as
the run directory (root only; skipped elsewhere).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TWO_STEPS, copy_run

from tests.test_e2e_tiny import ROOT, _cmd, _run, env  # noqa: F401  (env is a fixture)

pytestmark = pytest.mark.e2e

RANK_FILE = "model/mp_rank_00_000/model.safetensors"
FAST = ("eval.every=0", "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=1", "checkpoint.keep_last=2")


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("dapo-mcore:")]
    assert len(lines) == 1 and stderr.strip().endswith(lines[0]), stderr[-3000:]
    assert "Traceback" not in stderr
    return lines[0]


def _flip_4k(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_checkpoints(finished_two_steps, tmp_path_factory) -> Path:
    """The session's finished 2-step run (conftest; its overrides are FAST's), copied: this module damages it."""
    assert set(TWO_STEPS[1:]) | {"checkpoint.keep_last=2"} == set(FAST)  # the same run as train.steps=2 + FAST
    run_dir = copy_run(finished_two_steps, tmp_path_factory.mktemp("integrity") / "run")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    return run_dir


def test_flipped_bytes_in_the_latest_checkpoint_fall_back_to_the_previous_one(env, two_checkpoints):  # noqa: F811
    ckpts = two_checkpoints / "checkpoints"
    _flip_4k(ckpts / "step_000002" / RANK_FILE)
    done = _run(_cmd(two_checkpoints, "train.steps=3", *FAST), env)
    assert done.returncode == 0, done.stderr[-3000:]
    skipped = [line for line in done.stderr.splitlines() if "is corrupt" in line]
    assert len(skipped) == 1 and str(ckpts / "step_000002" / RANK_FILE) in skipped[0], skipped
    assert "next: step_000001" in skipped[0]
    assert f"loaded checkpoint {ckpts / 'step_000001'} (step 1)" in done.stderr
    assert (ckpts / "latest").read_text().strip() == "step_000003"


def test_no_intact_checkpoint_exits_2_naming_the_files(env, two_checkpoints):  # noqa: F811
    ckpts = two_checkpoints / "checkpoints"
    for step in sorted(ckpts.glob("step_*")):
        path = step / RANK_FILE
        path.write_bytes(path.read_bytes()[:1000])  # truncated
    before = sorted(p.name for p in ckpts.iterdir())
    done = _run(_cmd(two_checkpoints, "train.steps=4", *FAST), env)
    assert done.returncode == 2
    line = _error_line(done.stderr)
    assert f"no intact checkpoint in {ckpts}" in line and "(truncated)" in line
    assert str(ckpts / before[-1] / RANK_FILE) in line
    assert sorted(p.name for p in ckpts.iterdir()) == before  # nothing deleted, nothing started over

    evaluated = _run([sys.executable, "-m", "dapo_mcore.cli", "eval", str(ROOT / "examples" / "tiny_cpu.yaml"),
                      f"run.dir={two_checkpoints}", "--checkpoint", str(ckpts / before[-1])], env)
    assert evaluated.returncode == 2
    line = _error_line(evaluated.stderr)
    assert "is corrupt" in line and str(ckpts / before[-1] / RANK_FILE) in line


def test_full_disk_mid_run_is_one_line_and_the_next_start_cleans_up(env, tmp_path):  # noqa: F811
    point = tmp_path / "small"
    point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()[:80]})")
    try:
        run_dir = point / "run"
        done = _run(_cmd(run_dir, "train.steps=3", *FAST), env)
        assert done.returncode == 2
        line = _error_line(done.stderr)
        assert "No space left on device" in line and str(run_dir) in line and "free space" in line
        assert list((run_dir / "checkpoints").glob("*.partial"))  # the interrupted save
        subprocess.run(["mount", "-o", "remount,size=16m", str(point)], check=True)
        done = _run(_cmd(run_dir, "train.steps=2", *FAST), env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "left by an interrupted checkpoint save" in done.stderr
        assert not list((run_dir / "checkpoints").glob("*.partial"))
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
