"""`--io direct|buffered|auto` on the filesystems HPC jobs meet: tmpfs (node-local /dev/shm), ramfs (refuses
O_DIRECT at open), a filesystem that accepts O_DIRECT at open and refuses the writes (FUSE, some network
clients: simulated), and a large preferred block size (Lustre/GPFS stripes: simulated). Every mode gives the
same bytes or, for `direct` where it cannot work, a one-line error naming the fix."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.mcore_to_hf import convert_mcore_to_hf
from conversion.synthetic import save_tiny_hf_model
from dapo_mcore.weights import ParallelLayout, staged_io
from dapo_mcore.weights.errors import OutputPathError
from dapo_mcore.weights.staged_io import StagedFileWriter, io_mode, write_alignment

pytestmark = pytest.mark.unit

PAYLOAD = bytes(range(256)) * 400 + b"tail"  # 102_404 bytes: not a multiple of any block size


def _write(path: Path, direct, buffer_bytes=8192) -> StagedFileWriter:
    with StagedFileWriter(path, direct=direct, buffer_bytes=buffer_bytes, num_buffers=2) as w:
        for i in range(0, len(PAYLOAD), 3000):
            w.write(PAYLOAD[i:i + 3000])
    assert path.read_bytes() == PAYLOAD
    return w


def test_io_mode_names():
    assert (io_mode("direct"), io_mode("buffered"), io_mode("auto")) == (True, False, None)
    with pytest.raises(ValueError, match="choose one of direct, buffered, auto"):
        io_mode("fast")


def _einval_once(monkeypatch):
    real, calls = os.pwrite, {"n": 0}

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 2:  # the second buffer: the filesystem took the O_DIRECT open, refuses this write
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(staged_io.os, "pwrite", pwrite)
    return calls


def test_write_time_refusal_falls_back_in_auto_mode(tmp_path, monkeypatch):
    calls = _einval_once(monkeypatch)
    w = _write(tmp_path / "auto.bin", None)
    assert calls["n"] > 2 and not w.direct  # switched to the page cache and rewrote the refused buffer


def test_write_time_refusal_is_a_user_error_in_direct_mode(tmp_path, monkeypatch):
    _einval_once(monkeypatch)
    with pytest.raises(OutputPathError, match="refuses O_DIRECT, which --io direct requires; use --io auto"):
        _write(tmp_path / "direct.bin", True)


def test_alignment_follows_the_filesystem_block_size(tmp_path, monkeypatch):
    assert write_alignment(tmp_path) == os.stat(tmp_path).st_blksize
    real_stat = os.stat

    class Big:
        st_blksize = 1 << 20

    monkeypatch.setattr(staged_io.os, "stat", lambda p, *a, **k: Big() if Path(p) == tmp_path else real_stat(p))
    assert write_alignment(tmp_path) == 1 << 20
    w = _write(tmp_path / "big.bin", None, buffer_bytes=8192)
    if w.align == 1 << 20:  # O_DIRECT accepted here: buffers grew to the alignment, padding cut again
        assert w.buffer_bytes == 1 << 20
    Big.st_blksize = 3000  # not a power of two: the page size is used
    assert write_alignment(tmp_path) == 4096


def _mount(kind: str, where: Path) -> bool:
    where.mkdir()
    if os.geteuid() != 0:
        return False
    opts = ["-o", "size=64m"] if kind == "tmpfs" else []
    return subprocess.run(["mount", "-t", kind, *opts, kind, str(where)], capture_output=True).returncode == 0


@pytest.mark.parametrize("kind", ["tmpfs", "ramfs"])
def test_round_trip_on_mounted_filesystems(tmp_path, kind):
    mnt = tmp_path / kind
    if not _mount(kind, mnt):
        pytest.skip(f"cannot mount {kind} here (needs root)")
    try:
        hf = tmp_path / "hf"
        save_tiny_hf_model(hf, seed=4, tie_word_embeddings=False)
        ref = load_file(hf / "model.safetensors")
        for mode in ("auto", "buffered", "direct"):
            out = mnt / f"m_{mode}"
            if kind == "ramfs" and mode == "direct":
                with pytest.raises(OutputPathError, match="refuses O_DIRECT"):
                    convert_hf_to_mcore(hf, out, ParallelLayout(tp=2), direct=io_mode(mode))
                assert not [p for p in mnt.iterdir() if ".partial" in p.name or p.name == "m_direct"]
                continue
            convert_hf_to_mcore(hf, out, ParallelLayout(tp=2), direct=io_mode(mode))
            convert_mcore_to_hf(out, mnt / f"hf_{mode}", direct=io_mode(mode))
            back = load_file(mnt / f"hf_{mode}" / "model.safetensors")
            assert sorted(back) == sorted(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
            del back  # memory-mapped: would keep the mount busy
            for rank in ("mp_rank_00_000", "mp_rank_01_000"):  # every mode writes the same bytes
                assert (out / rank / "model.safetensors").read_bytes() == \
                    (mnt / "m_auto" / rank / "model.safetensors").read_bytes()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.parametrize("kind,opts,match", [("ro", ["-o", "ro,size=1m"], "read-only file system.*writable"),
                                             ("full", ["-o", "size=64k"], "No space left on device.*free space")])
def test_read_only_and_full_filesystems_are_one_line_errors(tmp_path, capsys, kind, opts, match):
    from conversion.hf_to_mcore import main as hf_to_mcore_main

    mnt = tmp_path / kind
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", *opts, "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs here (needs root)")
    try:
        save_tiny_hf_model(tmp_path / "hf", seed=4)
        with pytest.raises(OutputPathError, match=f"(?i){match}"):
            convert_hf_to_mcore(tmp_path / "hf", mnt / "out", ParallelLayout())
        capsys.readouterr()
        assert hf_to_mcore_main(["--hf", str(tmp_path / "hf"), "--out", str(mnt / "out"), "--no-progress"]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("dapo-mcore convert:")]
        assert len(err) == 1 and str(mnt / "out") in err[0]
        assert list(mnt.iterdir()) == []  # no .partial left behind
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)
