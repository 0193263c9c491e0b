"""The canonical on-disk Megatron checkpoint of dapo-mcore (what `hf_to_mcore` writes and the actor loads).

Layout::

    <dir>/dapo_mcore_checkpoint.json              format version, HF config, tp/pp/vpp, layer spec, vocab, dtype
    <dir>/mp_rank_{tp:02d}_{pp:03d}/model.safetensors   that rank's GPTModel chunk(s) state dict

Keys are Megatron state-dict names (local layer indices), prefixed ``chunk{v}.`` when VPP > 1. Only tensors
are stored (Transformer Engine ``_extra_state`` entries are not). Writers build the checkpoint in a temp
directory next to the target and rename it into place at the end, so the target is never half written.

Integrity: a directory may carry a ``manifest.json`` with every file's size and checksum (XXH3-64 by default, CRC-32
and SHA-256 accepted: ``weights.checksums``; `file_digest`, `write_manifest`); `verify_files` checks them (a size
first, which catches truncation without reading the file).
The trainer writes one per checkpoint and verifies it before resuming (``actor.checkpoint``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dapo_mcore.weights.atomic import atomic_directory, check_target_free, temp_dir_for  # noqa: F401 (re-exported)
from dapo_mcore.weights.checksums import DEFAULT_HASH, HASHES, digest_of, new_hasher
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
    text = json.dumps(meta.to_json(), indent=2, sort_keys=True) + "\n"
    write_bytes(Path(directory) / METADATA_FILE, text.encode())


def read_megatron_rank(directory: str | Path, tp_rank: int, pp_rank: int,
                       ep_rank: int | None = None) -> dict[str, torch.Tensor]:
    """The full state dict of one (tp, pp[, ep]) rank file (memory-mapped tensors; read whole and checked as it is
    read while `checking_reads` covers it)."""
    directory = resolve_checkpoint_dir(directory)
    path = rank_file(directory, tp_rank, pp_rank, ep_rank)
    if not path.exists():
        meta = read_meta(directory)
        raise CheckpointError(f"{path} does not exist; the checkpoint has tp={meta.layout.tp} pp={meta.layout.pp}.")
    if _checking is not None and _checking.covers(path):
        return _checking.read_safetensors(path)
    return load_file(os.fspath(path))


def read_rank_tensor(directory: str | Path, tp_rank: int, pp_rank: int, key: str,
                     ep_rank: int | None = None) -> torch.Tensor:
    path = rank_file(directory, tp_rank, pp_rank, ep_rank)
    if _checking is not None and _checking.covers(path):
        _checking.verify(path)  # a slice of the file is read: its checksum needs a pass of its own
    with safe_open(os.fspath(path), framework="pt") as f:
        return f.get_tensor(key)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``; a failed write is raised as an OSError naming `path` (safetensors raises its
    own error type with the errno only in the message), so callers and the CLI treat it like any I/O error.

    While `record_digests` is active the file is written tensor by tensor from the tensors' memory and its checksum
    is computed from the same bytes as they are written, for the manifest (`_write_safetensors_digested`)."""
    from safetensors.torch import save_file

    if _recording is not None:
        _recording.add(path, _write_safetensors_digested(tensors, Path(path), metadata))
        return
    try:
        save_file(tensors, os.fspath(path), metadata)
    except Exception as err:
        found = re.search(r"os error (\d+)", str(err))
        if isinstance(err, OSError) or found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), os.fspath(path)) from err


def _write_safetensors_digested(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None, *,
                                algo: str | None = DEFAULT_HASH) -> dict[str, Any]:
    """Write a standard safetensors file straight from the tensors' memory (one copy, into the page cache; safetensors'
    ``save_file`` first builds the whole file in memory) while a second thread hashes each tensor's bytes in order
    (both release the GIL); returns ``{"size", algo}`` of the file: no second read. ``algo=None``: the same write
    without a hash (the checksum benchmark's baseline), returning ``{"size"}``."""
    from concurrent.futures import ThreadPoolExecutor

    from dapo_mcore.weights.safetensors_io import _DTYPE_TO_ST

    views, header, offset = [], {"__metadata__": metadata or {"format": "pt"}}, 0
    for name, tensor in tensors.items():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        view = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        header[name] = {"dtype": _DTYPE_TO_ST[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(view)]}
        offset += len(view)
        views.append((flat, view))
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    head = len(blob).to_bytes(8, "little") + blob
    hasher, size = new_hasher(algo) if algo is not None else None, len(head) + offset
    try:
        with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as pool:
            f.write(head)
            pending = pool.submit(hasher.update, head) if hasher is not None else None
            for _, view in views:
                if pending is not None:
                    pending.result()  # one update at a time: the hash takes the bytes in file order
                    pending = pool.submit(hasher.update, view)
                f.write(view)
            if pending is not None:
                pending.result()
    except OSError as err:
        raise OSError(err.errno, err.strerror, os.fspath(path)) from err
    return {"size": size} if hasher is None else {"size": size, algo: hasher.hexdigest()}


def torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` through memory, so that a failed write is an OSError naming `path` (torch's is a RuntimeError
    about zip offsets). For small objects: RNG states, optimizer metadata."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(path, buffer.getbuffer())


def write_bytes(path: str | Path, data: bytes | memoryview) -> None:
    """Write a small file whole (recording its digest while `record_digests` is active)."""
    with open(path, "wb") as f:
        f.write(data)
    if _recording is not None:
        _recording.add(path, {"size": len(data), DEFAULT_HASH: digest_of(data)})


class DigestLog:
    """The size and checksum of every file this process wrote while `record_digests` was active, by absolute path."""

    def __init__(self) -> None:
        self.digests: dict[str, dict[str, Any]] = {}

    def add(self, path: str | Path, digest: dict[str, Any]) -> None:
        self.digests[os.fspath(Path(path).absolute())] = digest

    def moved(self, src: str | Path, dst: str | Path) -> None:
        """Directory `src` was renamed to `dst`: its files' digests follow."""
        src, dst = Path(src).absolute(), Path(dst).absolute()
        self.digests = {os.fspath(dst / Path(p).relative_to(src)) if Path(p).is_relative_to(src) else p: d
                        for p, d in self.digests.items()}

    def under(self, root: str | Path) -> dict[str, dict[str, Any]]:
        """The digests of the files under `root`, by POSIX path relative to it."""
        root = Path(root).absolute()
        return {Path(p).relative_to(root).as_posix(): d for p, d in self.digests.items()
                if Path(p).is_relative_to(root)}


_recording: DigestLog | None = None


def note_moved(src: str | Path, dst: str | Path) -> None:
    """Tell `record_digests` (if active) that directory `src` was renamed to `dst`."""
    if _recording is not None:
        _recording.moved(src, dst)


@contextlib.contextmanager
def record_digests() -> Iterator[DigestLog]:
    """Record the digest of each file `save_safetensors`, `torch_save` and `write_bytes` write (no re-read)."""
    global _recording
    previous, _recording = _recording, DigestLog()
    try:
        yield _recording
    finally:
        _recording = previous


# ---- integrity: per-file size + checksum ----------------------------------------------------------------------
# The algorithms (HASHES) and the default one (DEFAULT_HASH) are named in weights.checksums.


def file_digest(path: str | Path, algo: str = DEFAULT_HASH, *, chunk_bytes: int = 8 << 20) -> dict[str, Any]:
    """``{"size": bytes, algo: hex digest}`` of one file, read in chunks (bounded memory)."""
    hasher, size = new_hasher(algo), 0
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
            size += n
    return {"size": size, algo: hasher.hexdigest()}


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
    """The manifest of `root`, or None if it has none; CheckpointError if it is unreadable or malformed (a flipped
    bit in a key, an entry that is not a size and a checksum): a damaged manifest is a damaged checkpoint."""
    path = Path(root) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_text())
        if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
            raise ValueError("no 'files' table")
        problem = table_problem(body["files"])
        if problem is None and "world_size" in body and not _positive_int(body["world_size"]):
            problem = f"world_size {body['world_size']!r} is not a positive integer"
        if problem is not None:
            raise ValueError(problem)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from err
    return body


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _size_of(entry: Any) -> int | None:
    size = entry.get("size") if isinstance(entry, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None


def _algo_of(entry: Any) -> str | None:
    return next((a for a in HASHES if isinstance(entry, dict) and isinstance(entry.get(a), str)), None)


def table_problem(files: Any) -> str | None:
    """What is wrong with a checksum table ({relative path: {"size": bytes, algo: hex}}), or None: every entry must
    hold a size and a known checksum, so that checking files against it never meets a missing key."""
    if not isinstance(files, dict):
        return "its file table is not a mapping"
    for name, want in files.items():
        if _size_of(want) is None:
            return f"entry {name!r} holds no size"
        if _algo_of(want) is None:
            return f"entry {name!r} holds no {' or '.join(HASHES)} checksum"
    return None


def verify_files(root: str | Path, files: dict[str, dict[str, Any]], names: list[str] | None = None, *,
                 contents: bool = True) -> list[str]:
    """Check `names` (default: all) of the manifest table `files` against the files under `root`.

    Returns one problem per bad file, naming it ("model/x.safetensors: 4096 bytes, expected 8192 (truncated)");
    sizes are compared before anything is read, and only sizes without `contents`.
    """
    root = Path(root)
    problems = []
    malformed = table_problem(files)
    if malformed is not None:
        return [f"{root}: the checksum table is malformed ({malformed})"]
    for name in files if names is None else names:
        want, path = files[name], root / name
        try:
            size = path.stat().st_size
            if size != want["size"]:
                cut = " (truncated)" if size < want["size"] else ""
                problems.append(f"{path}: {size} bytes, the manifest says {want['size']}{cut}")
                continue
            algo = _algo_of(want)
            if contents and file_digest(path, algo)[algo] != want[algo]:
                problems.append(f"{path}: {algo} differs from the manifest (corrupt bytes)")
        except FileNotFoundError:
            problems.append(f"{path}: missing")
        except OSError as err:
            problems.append(f"{path}: unreadable ({err.strerror or err})")
    return problems


def nonfinite_tensors(path: str | Path) -> list[str]:
    """The tensors of safetensors file `path` that hold a NaN or an infinity (read one tensor at a time).

    A run whose update went non-finite writes a checkpoint with a valid manifest and NaN weights (older versions
    did): its checksum is right, so resume and export check the values too."""
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


# ---- checksums as files are read -----------------------------------------------------------------------------
class DamagedFileError(CheckpointError):
    """A file of a checkpoint differs from its manifest or holds NaN/inf (found while it was read)."""


class ReadCheck:
    """While `checking_reads` is active, the files of a manifest table that this process reads are checked: a rank
    file read whole (`read_megatron_rank`) is mapped once, its tensors handed out as views of the mapping at once,
    and its checksum (any of HASHES) and NaN/inf check run on a second thread while the caller copies those tensors
    into the model (both release the GIL); a file read in slices, or a small one, by a pass of its own (`verify`).
    `finish` waits for the checks. Files this process does not read are not read for the check. Damage raises
    DamagedFileError on this process only: the caller agrees across ranks before acting on it."""

    def __init__(self, root: str | Path, files: dict[str, dict[str, Any]]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.root, self.files, self.seen = Path(root).absolute(), files, set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")
        self._pending: list[Any] = []

    def covers(self, path: str | Path) -> bool:
        return Path(path).absolute().is_relative_to(self.root)

    def _name(self, path: str | Path) -> str:
        return Path(path).absolute().relative_to(self.root).as_posix()

    def verify(self, path: str | Path) -> None:
        name = self._name(path)
        if name in self.seen:
            return
        self.seen.add(name)
        if name not in self.files:
            raise DamagedFileError(f"{path}: not in the manifest")
        problems = verify_files(self.root, {name: self.files[name]})
        if problems:
            raise DamagedFileError(problems[0])

    def read_safetensors(self, path: str | Path) -> dict[str, torch.Tensor]:
        name = self._name(path)
        want = self.files.get(name)
        if want is None:  # not listed: the pass names it
            self.verify(path)
            return load_file(os.fspath(path))
        self.seen.add(name)
        problems = verify_files(self.root, {name: want}, contents=False)  # the size, from stat
        if problems:
            raise DamagedFileError(problems[0])
        buf = _map_file(Path(path))
        tensors = _parse_safetensors(buf, path)
        algo = _algo_of(want)
        self._pending.append(self._pool.submit(_check_bytes, buf, tensors, algo, want[algo], path))
        return tensors

    def finish(self) -> None:
        """Wait for the checks of the files read so far; DamagedFileError naming the first bad one."""
        pending, self._pending = self._pending, []
        problems = [p for p in (f.result() for f in pending) if p is not None]
        if problems:
            raise DamagedFileError(problems[0])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _map_file(path: Path) -> torch.Tensor:
    """The bytes of `path` as a uint8 tensor over a private (copy-on-write) mapping of it, as safetensors maps."""
    import mmap
    import warnings

    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(mapped, dtype=torch.uint8)


def _check_bytes(buf: torch.Tensor, tensors: dict[str, torch.Tensor], algo: str, want: str, path) -> str | None:
    """The problem of a mapped file (its `algo` digest against the manifest's `want`, then its values), or None."""
    view = memoryview(buf.numpy()).cast("B")
    hasher, step = new_hasher(algo), 16 << 20
    for at in range(0, len(view), step):
        hasher.update(view[at:at + step])
    if hasher.hexdigest() != want:
        return f"{path}: {algo} differs from the manifest (corrupt bytes)"
    bad = [k for k, t in tensors.items() if t.is_floating_point() and t.numel() and not _finite(t)]
    return describe_nonfinite(path, bad) if bad else None


def _finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in `t`: its min and max, one pass and no tensor of flags (a NaN propagates to both)."""
    low, high = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


_checking: ReadCheck | None = None


@contextlib.contextmanager
def checking_reads(root: str | Path, files: dict[str, dict[str, Any]]) -> Iterator[ReadCheck]:
    """Check the files of `files` (a manifest table of `root`) that this process reads while active; call the
    check's `finish` before relying on what was read."""
    global _checking
    previous, _checking = _checking, ReadCheck(root, files)
    try:
        yield _checking
    finally:
        _checking.close()
        _checking = previous


def _parse_safetensors(buf: torch.Tensor, path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buf` (uint8), as views of it where aligned, else copies."""
    from dapo_mcore.weights.safetensors_io import _ST_TO_DTYPE

    try:
        n = int.from_bytes(bytes(buf[:8].numpy()), "little")
        header = json.loads(bytes(buf[8:8 + n].numpy()))
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype, (a, b) = _ST_TO_DTYPE[info["dtype"]], info["data_offsets"]
            raw = buf[8 + n + a:8 + n + b]
            if raw.numel() != b - a:
                raise ValueError(f"{key} runs past the end of the file")
            if (8 + n + a) % dtype.itemsize:
                raw = raw.clone()  # a view must start at a multiple of its element size
            out[key] = raw.view(dtype).reshape(info["shape"])
        return out
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise DamagedFileError(f"{path}: not a readable safetensors file ({err})") from err
