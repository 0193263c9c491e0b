"""A damaged rollout store is detected, reported in one line, and never blocks the writer (set aside, start anew)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dapo_mcore.telemetry.rollout_store import (
    ROLLOUTS_DIR,
    Rollout,
    RolloutReader,
    RolloutStore,
    StoreDamagedError,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def _rollouts(step: int) -> list[Rollout]:
    return [Rollout(np.arange(1, 6) + step, np.arange(1, 7) + step + i, None, 1.0, True, "stop", True, i, 0)
            for i in range(3)]


def _store(run_dir: Path, steps: int = 6) -> Path:
    path = run_dir / ROLLOUTS_DIR
    store = RolloutStore(path, row_chunk=4, token_chunk=16)  # a step's 18 response tokens span two chunks
    for step in range(1, steps + 1):
        store.append_step(step, _rollouts(step))
    return path


def _chunk_of(path: Path, step: int) -> Path:
    """The response_ids chunk that holds the middle of ``step``'s tokens (18 per step, 16 per chunk)."""
    return path / "response_ids" / "c" / str(((step - 1) * 18 + 9) // 16)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "rollouts", *args], capture_output=True,
                          text=True, cwd=REPO)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("dapo-mcore:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("damage", ["delete", "truncate", "zero"])
def test_a_damaged_step_is_refused_in_one_line_and_the_others_still_read(tmp_path, damage):
    path = _store(tmp_path)
    chunk = _chunk_of(path, 3)
    if damage == "delete":
        chunk.unlink()  # zarr alone reads this as zeros: <pad><pad><pad>
    elif damage == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:10])
    else:
        chunk.write_bytes(bytes(len(chunk.read_bytes())))
    reader = RolloutReader(path)
    with pytest.raises(StoreDamagedError, match="step 3"):
        reader.read_step(3)
    assert [r.response_ids.tolist() for r in reader.read_step(6)] == [r.response_ids.tolist() for r in _rollouts(6)]
    line = _one_line(_cli(str(tmp_path), "--step", "3", "--raw"))
    assert f"rollout store {path}: step 3" in line and "--check" in line
    checked = _one_line(_cli(str(tmp_path), "--check"))
    assert "2 of 6 steps damaged: step 2: " in checked and "; step 3: " in checked  # the chunk holds both
    assert _cli(str(tmp_path), "--step", "6", "--raw").returncode == 0


def test_check_says_intact(tmp_path):
    _store(tmp_path)
    ok = _cli(str(tmp_path), "--check")
    assert ok.returncode == 0 and "6 steps, 1..6, all intact" in ok.stdout


@pytest.mark.parametrize("damage", ["root_half_written", "root_missing", "last_chunk_truncated", "last_chunk_deleted",
                                    "array_meta_garbage"])
def test_the_writer_sets_a_damaged_store_aside_and_starts_a_new_one(tmp_path, damage, caplog):
    path = _store(tmp_path)
    if damage == "root_half_written":
        meta = path / "zarr.json"
        meta.write_bytes(meta.read_bytes()[:100])
    elif damage == "root_missing":
        (path / "zarr.json").unlink()
    elif damage == "last_chunk_truncated":
        chunk = _chunk_of(path, 5)  # resume_step=6: step 5 is the one appended after
        chunk.write_bytes(chunk.read_bytes()[:7])
    elif damage == "last_chunk_deleted":
        _chunk_of(path, 5).unlink()
    else:
        (path / "reward" / "zarr.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        store = RolloutStore(path, resume_step=6)
    assert store.set_aside == path.with_name(f"{ROLLOUTS_DIR}.damaged-1") and store.set_aside.is_dir()
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warned) == 1 and "moved aside" in warned[0] and "new store starts from step 6" in warned[0]
    store.append_step(6, _rollouts(6))
    assert RolloutReader(path).steps() == [6]
    assert RolloutStore(path, resume_step=7).set_aside is None  # the new store is intact


def test_an_intact_store_is_continued_not_set_aside(tmp_path):
    path = _store(tmp_path)
    store = RolloutStore(path, resume_step=4)
    assert store.set_aside is None and store.steps == [1, 2, 3]


def test_report_names_a_damaged_store_in_one_warning(tmp_path):
    from dapo_mcore.telemetry.rollout_store import store_problem

    path = _store(tmp_path)
    assert store_problem(tmp_path) is None
    _chunk_of(path, 6).unlink()
    assert "step 6: its data differs from the checksum" in store_problem(tmp_path)
    (path / "zarr.json").write_text("{")
    assert "is damaged (JSONDecodeError" in store_problem(tmp_path)
