"""Damaged dist checkpoints end in one line, exit 2: the ones dapo-mcore writes carry checksums (a flipped byte is
named), every writer's ``.distcp`` is checked against the byte ranges its ``.metadata`` lists (a truncated file is
named), an unreadable ``.metadata`` is one line; Megatron-Bridge's (no checksums) are read as they are. A disk that
fills while the Bridge format is written is one line too, and the Bridge output's tokenizer path is its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dapo_mcore.weights import dist_checkpoint
from dapo_mcore.weights.errors import InputFileError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
ITER = "iter_0000000"
_FSIZE_LIMITED = """import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk with ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from conversion.synthetic import save_tiny_hf_model

    ws = tmp_path_factory.mktemp("damage")
    save_tiny_hf_model(ws / "hf", seed=5, tie_word_embeddings=False, vocab_size=96)
    (ws / "hf" / "tokenizer_config.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "conversion.hf_to_mcore", "--hf", str(ws / "hf"), "--out",
                           str(ws / "bridge"), "--format", "bridge", "--no-progress"], env=_env(),
                          capture_output=True, text=True, timeout=600, cwd=ws)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ws


def _copy(ws: Path, name: str, *, checksums: bool = True) -> Path:
    out = ws / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(ws / "bridge", out)
    if not checksums:  # as Megatron-Bridge writes it: no table, and no mark of ours in the common state
        (out / ITER / dist_checkpoint.CHECKSUMS).unlink()
        common = torch.load(out / ITER / "common.pt", weights_only=False)
        del common[dist_checkpoint.MARK]
        torch.save(common, out / ITER / "common.pt")
    return out


def _flip(path: Path, at: int, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


def _shard(ckpt: Path) -> Path:
    return sorted((ckpt / ITER).glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]


def test_the_checkpoints_we_write_carry_checksums_and_name_a_flipped_byte(written):
    ckpt = _copy(written, "flipped")
    dist_checkpoint.check_intact(dist_checkpoint.find(ckpt))  # intact: no error
    shard = _shard(ckpt)
    _flip(shard, shard.stat().st_size // 2)
    with pytest.raises(InputFileError) as err:
        dist_checkpoint.check_intact(dist_checkpoint.find(ckpt))
    assert f"{shard}: xxh3 differs" in str(err.value) and "\n" not in str(err.value)


def test_a_checkpoint_without_checksums_is_read_as_it_is(written):
    ckpt = _copy(written, "bridge_made", checksums=False)
    _flip(_shard(ckpt), _shard(ckpt).stat().st_size // 2)
    dist_checkpoint.check_intact(dist_checkpoint.find(ckpt))  # nothing to compare the bytes with: no error


@pytest.mark.parametrize("checksums", [True, False])
def test_a_truncated_shard_is_named(written, checksums):
    ckpt = _copy(written, f"cut_{checksums}", checksums=checksums)
    shard = _shard(ckpt)
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(InputFileError, match=r"truncated") as err:
        dist_checkpoint.check_intact(dist_checkpoint.find(ckpt))
    assert str(shard) in str(err.value) and "\n" not in str(err.value)


def test_a_truncated_metadata_is_one_line(written):
    ckpt = _copy(written, "meta", checksums=False)
    os.truncate(ckpt / ITER / ".metadata", 3000)
    with pytest.raises(InputFileError, match=r"its \.metadata cannot be read .*truncated or damaged") as err:
        dist_checkpoint.check_intact(dist_checkpoint.find(ckpt))
    assert "\n" not in str(err.value)


def test_convert_of_a_damaged_checkpoint_is_one_line_exit_2(written):
    ckpt = _copy(written, "cli")
    _flip(_shard(ckpt), 1000)
    proc = subprocess.run([sys.executable, "-m", "conversion.mcore_to_hf", "--format", "torch_dist", "--mcore",
                           str(ckpt), "--out", str(written / "back"), "--no-progress"], env=_env(),
                          capture_output=True, text=True, timeout=600, cwd=written)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"dapo-mcore convert: {ckpt / ITER} is damaged")
    assert not (written / "back").exists()


def test_the_bridge_output_names_its_own_tokenizer(written):
    run_config = yaml.safe_load((written / "bridge" / ITER / "run_config.yaml").read_text())
    tokenizer = Path(run_config["tokenizer"]["tokenizer_model"])
    assert tokenizer == (written / "bridge" / ITER / "tokenizer").resolve()
    assert (tokenizer / "tokenizer_config.json").is_file()


def test_a_full_disk_while_writing_the_bridge_format_is_one_line_exit_2(written, tmp_path):
    script = tmp_path / "limited.py"
    script.write_text(_FSIZE_LIMITED)
    proc = subprocess.run([sys.executable, str(script), "100000", "conversion.hf_to_mcore", "--hf",
                           str(written / "hf"), "--out", str(tmp_path / "out"), "--format", "bridge",
                           "--no-progress"], env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dapo-mcore convert: writing {tmp_path / 'out'} failed") and "too large" in last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["limited.py"]  # the partial output is gone


def test_a_checkpoint_of_ours_without_its_checksums_is_refused(written):
    ckpt = _copy(written, "table_deleted")
    (ckpt / ITER / dist_checkpoint.CHECKSUMS).unlink()
    with pytest.raises(InputFileError, match="written by dapo-mcore but its dapo_mcore_checksums.json is missing"):
        dist_checkpoint.check_intact(dist_checkpoint.find(ckpt))


def test_a_foreign_checkpoint_without_checksums_warns(written, caplog):
    ckpt = _copy(written, "foreign", checksums=False)
    with caplog.at_level("WARNING"):
        dist_checkpoint.check_intact(dist_checkpoint.find(ckpt))
    assert "carries no checksums" in caplog.text


def _flip_bit_in(text: str, needle: str) -> str:
    at = text.index(needle) + len(needle) - 1
    return text[:at] + chr(ord(text[at]) ^ 1) + text[at + 1:]


@pytest.mark.parametrize("damage", [
    lambda t: _flip_bit_in(t, '"size'), lambda t: _flip_bit_in(t, '"xxh3'), lambda t: _flip_bit_in(t, ".distcp"),
    lambda t: t.replace('"files": {', '"files": {"x": [1], ', 1), lambda t: '{"files": 3}', lambda t: "[1]",
])
def test_a_damaged_checksum_table_is_one_line(written, damage):
    ckpt = _copy(written, "table_damaged")
    table = ckpt / ITER / dist_checkpoint.CHECKSUMS
    table.write_text(damage(table.read_text()))
    with pytest.raises(InputFileError) as err:
        dist_checkpoint.check_intact(dist_checkpoint.find(ckpt))
    assert str(ckpt) in str(err.value) and "\n" not in str(err.value)


def test_a_process_checks_the_files_it_reads_not_every_file(written):
    ckpt = _copy(written, "reads")
    shard = _shard(ckpt)
    _flip(shard, shard.stat().st_size // 2)
    found = dist_checkpoint.find(ckpt)
    dist_checkpoint.check_intact(found, {".metadata", "metadata.json"})  # the index alone is intact
    dist_checkpoint.embedding_rows(found)  # it reads the index only: no error, and no read of the shards
    with pytest.raises(InputFileError, match="xxh3 differs"):
        dist_checkpoint.check_intact(found, {shard.name})  # a load that reads the shard finds it
