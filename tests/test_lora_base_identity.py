"""A LoRA checkpoint's base identity: new ones hash the base's files with XXH3-64, and the CRC-32 identity that
earlier versions wrote (no "hash" key; built here by hand with zlib) still accepts the same base and refuses another."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash

from dapo_mcore.actor import lora_state
from dapo_mcore.weights.checkpoint import CheckpointError

pytestmark = pytest.mark.unit


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    (base / "sub").mkdir(parents=True)
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 50)
    (base / "sub" / "extra.pt").write_bytes(b"pt-bytes")
    (base / "config.json").write_text("{}")  # not a weight file: outside the identity
    return base


def _naive(base: Path, algo: str) -> str:
    """The identity's digest over the weight files' lines "name:size:digest", each hash over the whole bytes."""
    files = [base / "model.safetensors", base / "sub" / "extra.pt"]
    if algo == "crc32":
        crc = 0
        for f in files:
            crc = zlib.crc32(f"{f.relative_to(base).as_posix()}:{f.stat().st_size}:"
                             f"{zlib.crc32(f.read_bytes()):08x}\n".encode(), crc)
        return f"{crc:08x}"
    lines = "".join(f"{f.relative_to(base).as_posix()}:{f.stat().st_size}:{xxhash.xxh3_64_hexdigest(f.read_bytes())}\n"
                    for f in files)
    return xxhash.xxh3_64_hexdigest(lines.encode())


def _checkpoint(tmp_path: Path, base_entry: dict) -> Path:
    ckpt = tmp_path / "step_000002"
    (ckpt / lora_state.LORA_DIR).mkdir(parents=True)
    body = {"base": base_entry, "rank": 4, "target_modules": ["q_proj"]}
    (ckpt / lora_state.LORA_DIR / lora_state.BASE_FILE).write_text(json.dumps(body))
    return ckpt


def _actor(base: Path) -> SimpleNamespace:
    return SimpleNamespace(lora=SimpleNamespace(rank=4, target_modules=["q_proj"]), base_source=str(base),
                           _base_identity=None)


@pytest.mark.parametrize("algo", ["xxh3", "crc32"])
def test_a_base_identity_of_either_hash_accepts_its_base_and_refuses_changed_bytes(tmp_path, algo):
    base = _base(tmp_path)
    if algo == "xxh3":  # what a save writes now
        entry = lora_state._shared_identity(_actor(base))
        assert entry["hash"] == "xxh3" and entry["files"] == 2
    else:  # what earlier versions wrote
        entry = {"path": str(base.resolve()), "digest": _naive(base, "crc32"), "files": 2}
    assert entry["digest"] == _naive(base, algo)
    ckpt = _checkpoint(tmp_path, entry)
    assert lora_state.check_lora(ckpt, _actor(base))["rank"] == 4
    data = bytearray((base / "model.safetensors").read_bytes())
    data[1000] ^= 1
    (base / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        lora_state.check_lora(ckpt, _actor(base))
    assert f"(weights {algo} {entry['digest']})" in str(err.value) and "\n" not in str(err.value)


def test_a_base_identity_naming_an_unknown_hash_is_one_line(tmp_path):
    base = _base(tmp_path)
    ckpt = _checkpoint(tmp_path, {"path": str(base.resolve()), "digest": "00", "hash": "md5"})
    with pytest.raises(CheckpointError, match="unknown hash 'md5'") as err:
        lora_state.check_lora(ckpt, _actor(base))
    assert "\n" not in str(err.value)
