"""Checkpoint checksums without a second read: a rank's XXH3-64 is computed from the bytes as it writes them, and a
load checks the files a rank reads as it reads them (and no other file), each against a naive hash of the whole
file; manifests of earlier versions (CRC-32, or SHA-256), built here by hand with zlib / hashlib, verify the same
way."""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from dapo_mcore.weights import checkpoint as wckpt

pytestmark = pytest.mark.unit

RANK = "model/mp_rank_00_000/model.safetensors"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # mixed dtypes and odd sizes: later tensors start at offsets that are no multiple of their element size
    return {"a.bf16": torch.randn(3, 5, generator=g).bfloat16(), "b.f32": torch.randn(7, 9, generator=g),
            "c.i64": torch.arange(5), "d.f16": torch.randn(1, generator=g).half(),
            "e.big": torch.randn(300_000, generator=g)}


def _no_rereads(monkeypatch) -> list[str]:
    reads: list[str] = []
    monkeypatch.setattr(wckpt, "file_digest", lambda path, *a, **k: reads.append(str(path)) or {})
    return reads


def test_writes_record_the_xxh3_of_their_bytes_without_reading_them_back(tmp_path, monkeypatch):
    reads = _no_rereads(monkeypatch)
    (tmp_path / "model" / "mp_rank_00_000").mkdir(parents=True)
    tensors = _tensors()
    with wckpt.record_digests() as log:
        wckpt.save_safetensors(tensors, tmp_path / RANK, {"format": "pt"})
        wckpt.torch_save({"x": torch.ones(3)}, tmp_path / "rng.pt")
        wckpt.write_bytes(tmp_path / "state.json", b'{"step": 3}')
    assert reads == []
    digests = log.under(tmp_path)
    assert sorted(digests) == [RANK, "rng.pt", "state.json"]
    for name, digest in digests.items():
        data = (tmp_path / name).read_bytes()
        assert digest == {"size": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}, name
    loaded = load_file(tmp_path / RANK)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    for algo in ("crc32", "sha256"):  # the writer takes any manifest hash (the benchmark compares crc32)
        got = wckpt._write_safetensors_digested(tensors, tmp_path / RANK, {"format": "pt"}, algo=algo)
        assert got == {"size": len(data := (tmp_path / RANK).read_bytes()), algo: NAIVE[algo](data)}


def test_a_moved_directory_keeps_its_digests(tmp_path):
    (tmp_path / "tmp").mkdir()
    with wckpt.record_digests() as log:
        wckpt.write_bytes(tmp_path / "tmp" / "f", b"abc")
        (tmp_path / "tmp").rename(tmp_path / "model")
        wckpt.note_moved(tmp_path / "tmp", tmp_path / "model")
    assert log.under(tmp_path) == {"model/f": {"size": 3, "xxh3": xxhash.xxh3_64_hexdigest(b"abc")}}


NAIVE = {"xxh3": xxhash.xxh3_64_hexdigest, "crc32": lambda data: f"{zlib.crc32(data):08x}",
         "sha256": lambda data: hashlib.sha256(data).hexdigest()}
"""Each manifest algorithm over a file's whole bytes: xxh3 is what a save records now; crc32 is what earlier versions
recorded (and sha256 what they accepted)."""


def _checkpoint(tmp_path: Path, algo: str = "xxh3") -> tuple[Path, dict]:
    """Two rank files saved by the trainer's writer, and their manifest table: the one the save recorded (xxh3), or
    one of `algo` built by hand from the files' bytes, as an earlier version wrote it."""
    (tmp_path / "model" / "mp_rank_00_000").mkdir(parents=True)
    (tmp_path / "model" / "mp_rank_01_000").mkdir(parents=True)
    (tmp_path / "model" / wckpt.METADATA_FILE).write_text("{}")  # read_megatron_rank only looks for it
    with wckpt.record_digests() as log:
        wckpt.save_safetensors(_tensors(), tmp_path / RANK)
        wckpt.save_safetensors({"w": torch.ones(4)}, tmp_path / "model/mp_rank_01_000/model.safetensors")
    files = log.under(tmp_path)
    if algo != "xxh3":
        files = {n: {"size": len(data), algo: NAIVE[algo](data)}
                 for n in files for data in [(tmp_path / n).read_bytes()]}
    return tmp_path, files


@pytest.mark.parametrize("algo", list(NAIVE))
def test_a_manifest_of_each_hash_verifies_and_names_a_flipped_byte_streamed_and_in_a_pass(tmp_path, algo):
    root, files = _checkpoint(tmp_path, algo)
    assert {n: d[algo] for n, d in files.items()} == {n: NAIVE[algo]((root / n).read_bytes()) for n in files}
    assert wckpt.verify_files(root, files) == []
    with wckpt.checking_reads(root, files) as check:
        wckpt.read_megatron_rank(root / "model", 0, 0)
        check.finish()
    _flip(root / RANK, (root / RANK).stat().st_size // 2)
    with wckpt.checking_reads(root, files) as check, pytest.raises(wckpt.DamagedFileError) as err:
        wckpt.read_megatron_rank(root / "model", 0, 0)
        check.finish()
    assert str(err.value) == f"{root / RANK}: {algo} differs from the manifest (corrupt bytes)"
    assert wckpt.verify_files(root, files) == [str(err.value)]


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("algo", list(NAIVE))
def test_a_checked_read_returns_the_tensors_and_reads_each_file_once(tmp_path, monkeypatch, algo):
    root, files = _checkpoint(tmp_path, algo)
    reads = _no_rereads(monkeypatch)
    with wckpt.checking_reads(root, files) as check:
        got = wckpt.read_megatron_rank(root / "model", 0, 0)
        check.finish()
    want = _tensors()
    assert reads == [] and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_flipped_byte_in_a_file_this_rank_reads_is_damage(tmp_path):
    root, files = _checkpoint(tmp_path)
    _flip(root / RANK, (root / RANK).stat().st_size - 100)
    with wckpt.checking_reads(root, files) as check, pytest.raises(wckpt.DamagedFileError, match="xxh3 differs"):
        wckpt.read_megatron_rank(root / "model", 0, 0)
        check.finish()


def test_a_file_this_rank_does_not_read_is_not_read(tmp_path, monkeypatch):
    root, files = _checkpoint(tmp_path)
    _flip(root / RANK, 200)  # another rank's file
    reads = _no_rereads(monkeypatch)
    with wckpt.checking_reads(root, files) as check:
        assert torch.equal(wckpt.read_megatron_rank(root / "model", 1, 0)["w"], torch.ones(4))
        check.finish()
    assert reads == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_truncated_or_nonfinite_file_is_damage(tmp_path, bad):
    root, files = _checkpoint(tmp_path)
    data = (root / RANK).read_bytes()
    (root / RANK).write_bytes(data[:-8])
    with wckpt.checking_reads(root, files), pytest.raises(wckpt.DamagedFileError, match="truncated"):
        wckpt.read_megatron_rank(root / "model", 0, 0)
    with wckpt.record_digests() as log:
        wckpt.save_safetensors({"w": torch.tensor([1.0, bad, 2.0]).bfloat16()}, root / RANK)
    with wckpt.checking_reads(root, log.under(root)) as check, pytest.raises(wckpt.DamagedFileError, match="NaN"):
        wckpt.read_megatron_rank(root / "model", 0, 0)
        check.finish()
