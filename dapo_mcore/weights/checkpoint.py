"""The canonical on-disk Megatron checkpoint of dapo-mcore (what `hf_to_mcore` writes and the actor loads).

Layout::

    <dir>/dapo_mcore_checkpoint.json              format version, HF config, tp/pp/vpp, layer spec, vocab, dtype
    <dir>/mp_rank_{tp:02d}_{pp:03d}/model.safetensors   that rank's GPTModel chunk(s) state dict

Keys are Megatron state-dict names (local layer indices), prefixed ``chunk{v}.`` when VPP > 1. Only tensors
are stored (Transformer Engine ``_extra_state`` entries are not). Writers build the checkpoint in a temp
directory next to the target and rename it into place at the end, so the target is never half written.

Integrity: a directory may carry a ``manifest.json`` with every file's size and CRC-32 (`file_digest`,
`write_manifest`); `verify_files` checks them (a size first, which catches truncation without reading the file).
The trainer writes one per checkpoint and verifies it before resuming (``actor.checkpoint``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dapo_mcore.weights.atomic import atomic_directory, check_target_free, temp_dir_for  # noqa: F401 (re-exported)
from dapo_mcore.weights.errors import WeightsError
from dapo_mcore.weights.layout import ParallelLayout

log = logging.getLogger(__name__)

FORMAT_NAME = "dapo_mcore.megatron"
FORMAT_VERSION = 1
METADATA_FILE = "dapo_mcore_checkpoint.json"
MANIFEST_FILE = "manifest.json"


class CheckpointError(WeightsError):
    """A checkpoint that does not match what it is loaded into, or is malformed (message names the mismatch)."""


@dataclass(frozen=True)
class CheckpointMeta:
    """The contents of ``dapo_mcore_checkpoint.json``."""

    hf_config: dict[str, Any]
    layout: ParallelLayout
    padded_vocab_size: int
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "hf_config": self.hf_config,
                **self.layout.as_dict(), "padded_vocab_size": self.padded_vocab_size, "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointMeta:
        if data.get("format") != FORMAT_NAME or data.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"not a {FORMAT_NAME} v{FORMAT_VERSION} checkpoint (found format "
                                  f"{data.get('format')!r} version {data.get('format_version')!r}).")
        layout = ParallelLayout(tp=data["tp"], pp=data["pp"], vpp=data["vpp"], layer_spec=data["layer_spec"],
                                make_vocab_size_divisible_by=data["make_vocab_size_divisible_by"],
                                ep=data.get("ep", 1),  # written only for expert-parallel (MoE) checkpoints
                                etp=data.get("etp"),  # written only where expert-TP differs from TP
                                # absent from older checkpoints, which were all padded by Megatron-LM's rule
                                vocab_padding=data.get("vocab_padding", "megatron"))
        return cls(data["hf_config"], layout, data["padded_vocab_size"], data["dtype"])


def rank_dir_name(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """``mp_rank_TT_PPP``, with Megatron's ``_EEE`` expert-parallel suffix in a checkpoint of EP > 1."""
    suffix = "" if ep_rank is None else f"_{ep_rank:03d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}{suffix}"


def rank_file(directory: str | Path, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> Path:
    return Path(directory) / rank_dir_name(tp_rank, pp_rank, ep_rank) / "model.safetensors"


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The canonical model directory: `path` itself, or its ``model/`` subdirectory (a trainer checkpoint)."""
    path = Path(path)
    for candidate in (path, path / "model"):
        if (candidate / METADATA_FILE).exists():
            return candidate
    raise CheckpointError(f"{path} holds no {METADATA_FILE} (nor does {path / 'model'}); expected a checkpoint "
                          "written by hf_to_mcore or the trainer.")


def read_meta(directory: str | Path) -> CheckpointMeta:
    return CheckpointMeta.from_json(json.loads((resolve_checkpoint_dir(directory) / METADATA_FILE).read_text()))


def write_meta(directory: str | Path, meta: CheckpointMeta) -> None:
    (Path(directory) / METADATA_FILE).write_text(json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n")


def read_megatron_rank(directory: str | Path, tp_rank: int, pp_rank: int,
                       ep_rank: int | None = None) -> dict[str, torch.Tensor]:
    """The full state dict of one (tp, pp[, ep]) rank file (memory-mapped tensors)."""
    directory = resolve_checkpoint_dir(directory)
    path = rank_file(directory, tp_rank, pp_rank, ep_rank)
    if not path.exists():
        meta = read_meta(directory)
        raise CheckpointError(f"{path} does not exist; the checkpoint has tp={meta.layout.tp} pp={meta.layout.pp}.")
    return load_file(os.fspath(path))


def read_rank_tensor(directory: str | Path, tp_rank: int, pp_rank: int, key: str,
                     ep_rank: int | None = None) -> torch.Tensor:
    with safe_open(os.fspath(rank_file(directory, tp_rank, pp_rank, ep_rank)), framework="pt") as f:
        return f.get_tensor(key)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``; a failed write is raised as an OSError naming `path` (safetensors raises its
    own error type with the errno only in the message), so callers and the CLI treat it like any I/O error."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, os.fspath(path), metadata)
    except Exception as err:
        found = re.search(r"os error (\d+)", str(err))
        if isinstance(err, OSError) or found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), os.fspath(path)) from err


def torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` through memory, so that a failed write is an OSError naming `path` (torch's is a RuntimeError
    about zip offsets). For small objects: RNG states, optimizer metadata."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


# ---- integrity: per-file size + checksum ----------------------------------------------------------------------
HASHES = ("crc32", "sha256")
"""CRC-32 (zlib) by default: it catches the accidents a checkpoint meets (flipped, zeroed or missing bytes) and
runs several times faster than SHA-256 on CPUs (docs/results.md); sha256 manifests verify as well."""


def file_digest(path: str | Path, algo: str = "crc32", *, chunk_bytes: int = 8 << 20) -> dict[str, Any]:
    """``{"size": bytes, algo: hex digest}`` of one file, read in chunks (bounded memory)."""
    if algo not in HASHES:
        raise ValueError(f"unknown hash {algo!r}; choose one of {', '.join(HASHES)}.")
    crc, sha, size = 0, hashlib.sha256() if algo == "sha256" else None, 0
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            part = view[:n]
            if sha is None:
                crc = zlib.crc32(part, crc)
            else:
                sha.update(part)
            size += n
    return {"size": size, algo: f"{crc:08x}" if sha is None else sha.hexdigest()}


def list_files(root: str | Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Every regular file under `root`, as sorted POSIX paths relative to it (minus the top-level `exclude`)."""
    root = Path(root)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.relative_to(root).as_posix() not in exclude)


def write_manifest(root: str | Path, digests: dict[str, dict[str, Any]], **extra: Any) -> None:
    """Write ``root/manifest.json``: {"files": {relative path: digest}, **extra}."""
    body = {"files": dict(sorted(digests.items())), **extra}
    (Path(root) / MANIFEST_FILE).write_text(json.dumps(body, indent=1) + "\n")


def read_manifest(root: str | Path) -> dict[str, Any] | None:
    """The manifest of `root`, or None if it has none; CheckpointError if it is unreadable."""
    path = Path(root) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text())
        if not isinstance(body.get("files"), dict):
            raise ValueError("no 'files' table")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from err
    return body


def verify_files(root: str | Path, files: dict[str, dict[str, Any]], names: list[str] | None = None) -> list[str]:
    """Check `names` (default: all) of the manifest table `files` against the files under `root`.

    Returns one problem per bad file, naming it ("model/x.safetensors: 4096 bytes, expected 8192 (truncated)");
    sizes are compared before anything is read.
    """
    root = Path(root)
    problems = []
    for name in files if names is None else names:
        want, path = files[name], root / name
        try:
            size = path.stat().st_size
            if size != want["size"]:
                cut = " (truncated)" if size < want["size"] else ""
                problems.append(f"{path}: {size} bytes, the manifest says {want['size']}{cut}")
                continue
            algo = next((a for a in HASHES if a in want), None)
            if algo is None:
                problems.append(f"{path}: the manifest holds no known checksum ({', '.join(HASHES)})")
            elif file_digest(path, algo)[algo] != want[algo]:
                problems.append(f"{path}: {algo} differs from the manifest (corrupt bytes)")
        except FileNotFoundError:
            problems.append(f"{path}: missing")
        except OSError as err:
            problems.append(f"{path}: unreadable ({err.strerror or err})")
    return problems


def nonfinite_tensors(path: str | Path) -> list[str]:
    """The tensors of safetensors file `path` that hold a NaN or an infinity (read one tensor at a time).

    A run whose update went non-finite writes a checkpoint with a valid manifest and NaN weights (older versions
    did): its CRC is right, so resume and export check the values too."""
    bad = []
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  (safe_open handles have keys(), not iteration)
            t = f.get_tensor(key)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(key)
    return bad


def describe_nonfinite(path: str | Path, keys: list[str]) -> str:
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return f"{path}: NaN or inf values in {shown} (saved from a run whose update went non-finite)"
