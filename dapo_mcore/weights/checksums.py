"""The checksums a checkpoint's manifest may hold, and the one that new manifests hold (`DEFAULT_HASH`).

XXH3-64 (``xxhash``) by default: like CRC-32 it catches the accidents a checkpoint meets (flipped, zeroed or missing
bytes), at several times CRC-32's speed (docs/results.md), so hashing a file as it is written or read costs a
fraction of the copy. Manifests written with CRC-32 (zlib) or SHA-256 verify as well. Every hash here is streamed
(`new_hasher`: ``update`` with the bytes in order, then ``hexdigest``) and releases the GIL on large buffers, so the
readers and writers run it on a second thread beside the copy.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Protocol

DEFAULT_HASH = "xxh3"
"""The checksum new manifests record: XXH3-64, as 16 hex digits of its 64-bit value."""
HASHES = (DEFAULT_HASH, "crc32", "sha256")
"""The checksums a manifest entry may hold (``{"size": bytes, <one of these>: hex digest}``)."""


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC-32 behind the streaming interface of hashlib (8 hex digits, as manifests have always held it)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(algo: str = DEFAULT_HASH) -> Hasher:
    """A fresh streaming hash of manifest algorithm `algo` (one of `HASHES`)."""
    if algo == "xxh3":
        import xxhash

        return xxhash.xxh3_64()
    if algo == "crc32":
        return _Crc32()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash {algo!r}; choose one of {', '.join(HASHES)}.")


def digest_of(data: bytes | memoryview, algo: str = DEFAULT_HASH) -> str:
    """The hex digest of `data` (whole, in memory) with `algo`."""
    hasher = new_hasher(algo)
    hasher.update(data)
    return hasher.hexdigest()
