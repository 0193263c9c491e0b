"""find_latest on hand-made checkpoint trees: partial and corrupt checkpoints are never picked."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dapo_mcore.actor.checkpoint import find_latest

pytestmark = pytest.mark.unit


def _complete(root: Path, step: int) -> Path:
    d = root / f"step_{step:06d}"
    (d / "model").mkdir(parents=True)
    (d / "model" / "dapo_mcore_checkpoint.json").write_text(json.dumps({"format": "x"}))
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    (d / "COMPLETE").write_text(str(step))
    return d


def _partial(root: Path, step: int) -> Path:
    d = _complete(root, step)
    return d.rename(root / f"step_{step:06d}.partial")


def test_latest_marker_is_followed(tmp_path):
    _complete(tmp_path, 2)
    _complete(tmp_path, 4)
    (tmp_path / "latest").write_text("step_000002\n")
    assert find_latest(tmp_path).name == "step_000002"
    assert find_latest(tmp_path / "nowhere") is None
    assert find_latest(tmp_path / "step_000002" / "model") is None


def test_partial_checkpoint_is_never_picked(tmp_path, caplog):
    _complete(tmp_path, 2)
    _partial(tmp_path, 3)  # killed during save: even a full-looking .partial dir is not a checkpoint
    assert find_latest(tmp_path).name == "step_000002"
    (tmp_path / "latest").write_text("step_000003.partial")
    with caplog.at_level(logging.WARNING):
        assert find_latest(tmp_path).name == "step_000002"
    assert "missing or corrupt" in caplog.text
    # A step directory without COMPLETE (e.g. copied half-way) is skipped too.
    d = _complete(tmp_path, 5)
    (d / "COMPLETE").unlink()
    assert find_latest(tmp_path).name == "step_000002"


@pytest.mark.parametrize("marker", [b"step_000009", b"", b"garbage \x00\x01", b"\xff\xfe\xfd", b"../../etc"])
def test_corrupt_latest_marker_falls_back_with_a_warning(tmp_path, caplog, marker):
    _complete(tmp_path, 2)
    _complete(tmp_path, 4)
    (tmp_path / "latest").write_bytes(marker)
    with caplog.at_level(logging.WARNING):
        assert find_latest(tmp_path).name == "step_000004"
    assert "latest checkpoint marker" in caplog.text


def test_marker_naming_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    _complete(tmp_path, 2)
    newest = _complete(tmp_path, 4)
    (newest / "trainer_state.json").write_text('{"step": 4, "sampl')  # truncated by a crash / full disk
    (tmp_path / "latest").write_text("step_000004")
    with caplog.at_level(logging.WARNING):
        assert find_latest(tmp_path).name == "step_000002"
    assert "step_000004" in caplog.text
    (tmp_path / "latest").unlink()
    assert find_latest(tmp_path).name == "step_000002"  # the newest complete one is corrupt: skipped as well
