"""find_latest on hand-made checkpoint trees: partial, corrupt and truncated checkpoints are never picked."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from dapo_mcore.actor.checkpoint import check_intact, find_latest, remove_partials
from dapo_mcore.weights import checkpoint as wckpt
from dapo_mcore.weights.checkpoint import CheckpointError

pytestmark = pytest.mark.unit

RANK_FILE = "model/mp_rank_00_000/model.safetensors"


def _complete(root: Path, step: int, manifest: bool = True) -> Path:
    from safetensors.torch import save_file

    d = root / f"step_{step:06d}"
    (d / "model" / "mp_rank_00_000").mkdir(parents=True)
    (d / "model" / "dapo_mcore_checkpoint.json").write_text(json.dumps({"format": "x"}))
    save_file({"w": torch.arange(8192, dtype=torch.float32) + step}, d / RANK_FILE)  # 32 KB
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    if manifest:
        wckpt.write_manifest(d, {n: wckpt.file_digest(d / n) for n in wckpt.list_files(d)}, world_size=1)
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
    assert "not a complete checkpoint" in caplog.text
    # A step directory without COMPLETE (e.g. copied half-way) is skipped too.
    d = _complete(tmp_path, 5)
    (d / "COMPLETE").unlink()
    assert find_latest(tmp_path).name == "step_000002"


def test_partial_dirs_are_removed_at_start_and_never_named_as_the_checkpoint(tmp_path, caplog):
    _complete(tmp_path, 2)
    _partial(tmp_path, 3)
    (tmp_path / "step_000003.partial" / "model" / ".model.partial-1234abcd").mkdir()
    (tmp_path / "latest.tmp").write_text("step_000003")
    with caplog.at_level(logging.INFO):
        removed = remove_partials(tmp_path)
        assert find_latest(tmp_path).name == "step_000002"
    assert sorted(p.name for p in removed) == ["latest.tmp", "step_000003.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]
    assert all("interrupted" in r.message for r in caplog.records if "partial" in r.getMessage())


@pytest.mark.parametrize("marker", [b"step_000009", b"", b"garbage \x00\x01", b"\xff\xfe\xfd", b"../../etc"])
def test_corrupt_latest_marker_falls_back_with_a_warning(tmp_path, caplog, marker):
    _complete(tmp_path, 2)
    _complete(tmp_path, 4)
    (tmp_path / "latest").write_bytes(marker)
    with caplog.at_level(logging.WARNING):
        assert find_latest(tmp_path).name == "step_000004"
    assert "latest marker" in caplog.text


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


def _flip_4k(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.mark.parametrize("damage, needle", [(_flip_4k, "xxh3 differs from the manifest"),
                                            (_truncate, "(truncated)")])
def test_damaged_safetensors_in_the_latest_checkpoint_falls_back_naming_the_file(tmp_path, caplog, damage, needle):
    _complete(tmp_path, 2)
    newest = _complete(tmp_path, 4)
    (tmp_path / "latest").write_text("step_000004")
    damage(newest / RANK_FILE)
    with caplog.at_level(logging.WARNING):
        assert find_latest(tmp_path).name == "step_000002"
    lines = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(lines) == 1 and str(newest / RANK_FILE) in lines[0] and needle in lines[0], lines
    assert "next: step_000002" in lines[0]


def test_no_intact_checkpoint_raises_naming_every_bad_file(tmp_path):
    a, b = _complete(tmp_path, 2), _complete(tmp_path, 4)
    _flip_4k(a / RANK_FILE)
    (b / RANK_FILE).unlink()
    with pytest.raises(CheckpointError) as err:
        find_latest(tmp_path)
    msg = str(err.value)
    assert "no intact checkpoint in" in msg and str(tmp_path) in msg and "\n" not in msg
    assert f"step_000002: {a / RANK_FILE}: xxh3 differs" in msg and f"step_000004: {b / RANK_FILE}: missing" in msg


def test_unreadable_manifest_is_corruption_and_a_missing_one_is_legacy(tmp_path, caplog):
    d = _complete(tmp_path, 2)
    (d / wckpt.MANIFEST_FILE).write_text('{"files": {"mod')
    assert check_intact(d) and "unreadable" in check_intact(d)[0]
    legacy = _complete(tmp_path, 4, manifest=False)
    with caplog.at_level(logging.WARNING):
        assert check_intact(legacy) == []
    assert "not verified" in caplog.text


def test_manifest_digests_match_naive_checksums(tmp_path):
    import hashlib
    import zlib

    import xxhash

    path = tmp_path / "blob"
    data = bytes(range(256)) * 40_000 + b"tail"  # spans several read chunks
    path.write_bytes(data)
    assert wckpt.file_digest(path, chunk_bytes=1 << 16) == {"size": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}
    assert wckpt.file_digest(path, "crc32", chunk_bytes=1 << 16)["crc32"] == f"{zlib.crc32(data):08x}"
    assert wckpt.file_digest(path, "sha256")["sha256"] == hashlib.sha256(data).hexdigest()
    files = {"blob": wckpt.file_digest(path, "sha256")}
    assert wckpt.verify_files(tmp_path, files) == []
    path.write_bytes(data[:-1] + b"X")
    assert wckpt.verify_files(tmp_path, files) == [f"{path}: sha256 differs from the manifest (corrupt bytes)"]


def _flip_bit_in(text: str, needle: str) -> str:
    at = text.index(needle) + len(needle) - 1
    return text[:at] + chr(ord(text[at]) ^ 1) + text[at + 1:]


@pytest.mark.parametrize("damage, intact", [
    (lambda t: _flip_bit_in(t, '"size'), False),  # a key of an entry: {"sizd": ...}
    (lambda t: _flip_bit_in(t, '"xxh3'), False),
    (lambda t: _flip_bit_in(t, "model.safetensors"), False),  # a file's name: it is missing, another unlisted
    (lambda t: t.replace('"trainer_state.json": {', '"trainer_state.json": ["x"], "y": {', 1), False),
    (lambda t: t.replace('"files": {', '"files": {"model/x": 3, ', 1), False),
    (lambda t: '{"files": [1, 2]}', False),
    (lambda t: "[]", False),
    (lambda t: t.replace('"world_size": 1', '"world_size": "1"'), False),
    # the world size is a hint (the rng files count the ranks): with its key damaged the files still verify
    (lambda t: _flip_bit_in(t, '"world_size'), True),
])
def test_a_damaged_manifest_falls_back_to_the_previous_checkpoint(tmp_path, caplog, damage, intact):
    _complete(tmp_path, 2)
    newest = _complete(tmp_path, 4)
    (tmp_path / "latest").write_text("step_000004")
    manifest = newest / wckpt.MANIFEST_FILE
    damaged = damage(manifest.read_text())
    assert damaged != manifest.read_text()
    manifest.write_text(damaged)
    with caplog.at_level(logging.WARNING):
        found = find_latest(tmp_path)
    assert found.name == ("step_000004" if intact else "step_000002")
    assert ("step_000004 is corrupt" in caplog.text) != intact
