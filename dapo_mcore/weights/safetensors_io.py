"""Safetensors reading by slices and writing tensor by tensor, so memory stays bounded by one tensor.

`StreamingSafetensorsWriter` writes a standard safetensors file whose header is known up front (names, dtypes,
shapes), then appends each tensor's bytes in header order: no file ever needs all its tensors in memory.
`SafetensorsDirSource` reads one HF checkpoint directory (a single file or shards + index json) as a
`TensorSource`: contiguous ranges by positioned reads, strided ones from the memory map (safetensors
``get_slice``), opened per read so mapped pages are released with each tensor. For file-to-file conversion,
`SafetensorsDirSource.copy_extents` + `StreamingSafetensorsWriter.write_extents` move byte ranges from the
source files straight into the writer's staging buffers (`staged_io`), with no intermediate tensor.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from dapo_mcore.weights.checksums import DEFAULT_HASH
from dapo_mcore.weights.errors import InputFileError, InputMissingError
from dapo_mcore.weights.staged_io import StagedFileWriter
from dapo_mcore.weights.transforms import ZERO, Extent

_DTYPE_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}.")
    return DTYPE_NAMES[name]


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order of `entries` (name, dtype, shape).

    Bytes go through a `StagedFileWriter` (large positioned writes from a thread); `direct` is its O_DIRECT
    choice (False: page cache, as a plain file write; None: O_DIRECT where the filesystem allows it).
    """

    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, *, direct: bool | None = False, checksum: bool = False):
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._pending: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in entries:
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPE_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self._pending.append((name, dtype, tuple(shape)))
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.path = Path(path)
        # staging buffers no larger than the file (fresh pages cost a fault each; small files are the common case)
        staging = min(64 << 20, max(1 << 20, -(-(len(blob) + 8 + offset) // 4096) * 4096))
        self._file = StagedFileWriter(self.path, direct=direct, checksum=checksum, buffer_bytes=staging)
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def _expect(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        exp_name, exp_dtype, exp_shape = self._pending[self._next]
        if name != exp_name or dtype != exp_dtype or tuple(shape) != exp_shape:
            raise ValueError(f"{self.path.name}: expected {exp_name} {exp_dtype} {exp_shape}, got {name} "
                             f"{dtype} {tuple(shape)}")

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._expect(name, tensor.dtype, tuple(tensor.shape))
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(data)
        self._next += 1

    def write_extents(self, name: str, source: SafetensorsDirSource, hf_names: tuple[str, ...],
                      extents: list[Extent]) -> None:
        """Write the next tensor as byte ranges of `source` tensors (`transforms.shard_extents`), no cast."""
        exp_name, dtype, shape = self._pending[self._next]
        self._expect(name, dtype, shape)
        wrong = [n for n in hf_names if source.dtype(n) != dtype]
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if wrong or sum(n for _, _, n in extents) != nbytes:
            raise ValueError(f"{self.path.name}: {name}: extents of {hf_names} do not make a {dtype} {shape} "
                             f"tensor (dtype mismatch in {wrong} or {sum(n for _, _, n in extents)} != {nbytes} B)")
        source.copy_extents(hf_names, extents, self._file)
        self._next += 1

    def close(self) -> None:
        missing = [n for n, _, _ in self._pending[self._next:]]
        self._file.close()
        if missing:
            raise ValueError(f"{self.path.name}: closed before writing {len(missing)} tensors ({missing[:3]}...)")

    def digest(self) -> dict[str, object]:
        """``{"size", DEFAULT_HASH}`` of the file written (after `close`; the writer was made with `checksum`)."""
        assert self._file.hasher is not None, "the writer was made without checksum=True"
        return {"size": self._file.size, DEFAULT_HASH: self._file.hasher.hexdigest()}

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.abort()


def _bad(path, what: str) -> InputFileError:
    return InputFileError(f"{path}: {what}; the file is damaged or was not fully copied: copy or download it again.")


def read_header_offsets(path: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """name -> (dtype, shape, absolute byte offset of its data) for every tensor of a safetensors file.

    The header is checked against the file before anything trusts it: the file holds every byte the header
    promises, each tensor's byte range matches its dtype and shape, and no two ranges overlap. A truncated
    or corrupt file raises InputFileError naming it.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"{size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise _bad(path, f"header length {n} exceeds the file size {size}")
            raw = f.read(n)
    except FileNotFoundError as err:
        raise InputMissingError(f"{path} does not exist.") from err
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad(path, f"the header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    header.pop("__metadata__", None)
    out: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
    spans = []
    for k, v in header.items():
        try:
            dtype, shape, (begin, end) = _ST_TO_DTYPE[v["dtype"]], tuple(int(d) for d in v["shape"]), v["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise _bad(path, f"tensor {k!r} has a malformed header entry {v!r}") from err
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or begin < 0:
            raise _bad(path, f"tensor {k!r}: data_offsets {[begin, end]} do not hold a {v['dtype']} {list(shape)}")
        if 8 + n + end > size:
            raise _bad(path, f"tensor {k!r} ends at byte {8 + n + end} but the file has {size} bytes (truncated)")
        spans.append((begin, end, k))
        out[k] = (dtype, shape, 8 + n + begin)
    spans.sort()
    for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise _bad(path, f"tensors {k0!r} and {k1!r} overlap")
    return out


def read_header(path: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file, reading only its header."""
    return {k: (d, s) for k, (d, s, _) in read_header_offsets(path).items()}


def _pread_into(path: Path, offset: int, out: torch.Tensor) -> None:
    view = memoryview(out.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise OSError(f"{path}: unexpected end of file at byte {offset + done}")
            done += got


class SafetensorsDirSource:
    """The tensors of an HF checkpoint directory, readable by name and by slice."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        if not self.dir.is_dir():
            raise InputMissingError(f"{self.dir} is not a directory.")
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise InputFileError(f"{index}: not a safetensors index (no weight_map): {err}; copy it again.") from err
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise InputMissingError(f"no *.safetensors files in {self.dir}; is it a Hugging Face checkpoint dir?")
        self.file_of: dict[str, Path] = {}
        self.meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.offset: dict[str, int] = {}
        for fname in files:
            path = self.dir / fname
            if not path.exists():
                raise InputMissingError(f"{path} is listed in {index.name} but missing; copy or download it again.")
            for name, (dtype, shape, offset) in read_header_offsets(path).items():
                if name in self.file_of:
                    raise InputFileError(f"{self.dir}: tensor {name} appears in both {self.file_of[name].name} and "
                                         f"{fname}; remove the stray file.")
                self.file_of[name] = path
                self.meta[name] = (dtype, shape)
                self.offset[name] = offset

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name][0]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """A tensor (or a range along `dim`) as a fresh CPU tensor.

        Whole tensors and row ranges are contiguous bytes in the file: they are read with one positioned
        read into a new tensor (no page-fault per 4 KiB as with the memory map). Column ranges are strided:
        they come from the memory-mapped file through safetensors' ``get_slice``.
        """
        dtype, shape = self.meta[name]
        if dim is None or dim == 0:
            rows = shape[0] if shape else 1
            start, stop = (0, rows) if dim is None else (start, rows if stop is None else stop)
            row_elems = int(torch.Size(shape[1:]).numel())
            out = torch.empty(((stop - start) * row_elems,), dtype=dtype)
            row_bytes = row_elems * out.element_size()
            _pread_into(self.file_of[name], self.offset[name] + start * row_bytes, out.view(torch.uint8))
            return out.view((stop - start, *shape[1:]) if shape else ())
        with safe_open(os.fspath(self.file_of[name]), framework="pt") as f:
            sl = f.get_slice(name)
            index = (slice(None),) * dim + (slice(start, stop),)
            return sl[index]

    def copy_extents(self, names: tuple[str, ...], extents: list[Extent], out: StagedFileWriter, *,
                     small: int = 256 << 10) -> None:
        """Append the bytes `extents` name (ranges of the tensors `names`) to `out`.

        Ranges of at least `small` bytes are read with positioned reads straight into `out`'s staging buffers;
        smaller ones (the rows of a column slice) are copied from a memory map of just that tensor, unmapped
        before returning so the mapped pages do not stay in this process.
        """
        with contextlib.ExitStack() as stack:
            fds: dict[Path, int] = {}
            maps: dict[str, tuple[memoryview, int]] = {}
            for idx, off, n in extents:
                if idx == ZERO:
                    out.write_zeros(n)
                    continue
                name = names[idx]
                path = self.file_of[name]
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                    stack.callback(os.close, fds[path])
                if n >= small:
                    out.read_into(fds[path], self.offset[name] + off, n)
                    continue
                if name not in maps:
                    maps[name] = self._map_tensor(name, fds[path], stack)
                view, base = maps[name]
                out.write(view[base + off: base + off + n])

    def _map_tensor(self, name: str, fd: int, stack: contextlib.ExitStack) -> tuple[memoryview, int]:
        """A read-only map of tensor `name`'s bytes (closed by `stack`); returns (view, tensor start in it)."""
        dtype, shape = self.meta[name]
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        start = self.offset[name] - self.offset[name] % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(fd, self.offset[name] + nbytes - start, prot=mmap.PROT_READ, offset=start)
        stack.callback(mapped.close)
        view = memoryview(mapped)
        stack.callback(view.release)
        return view, self.offset[name] - start
