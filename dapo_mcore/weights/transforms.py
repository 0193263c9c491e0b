"""The few tensor transforms between Hugging Face and Megatron layouts, one per kind of tensor-parallel split.

Each kind knows three things: the shape of one TP rank's Megatron tensor, how to cut that rank's tensor out
of the Hugging Face tensors (reading only the rows/columns it needs from a `TensorSource`, so a memory-mapped
safetensors file is never loaded whole), and how to merge all ranks' tensors back into Hugging Face tensors.

* ``replicated``: norms; every rank holds the full tensor.
* ``row``: row-parallel linears (attention output, MLP down): split on dim 1 (input features).
* ``vocab``: embedding / output layer: rows padded with zeros to the padded vocabulary, split on dim 0.
* ``qkv``: HF q, k, v fused per query group as ``[q heads of the group, k, v]`` and split on dim 0 by groups
  (weight and bias alike), so each rank holds whole groups.
* ``gate_up``: HF gate and up each split on dim 0, then concatenated per rank as ``[gate_r; up_r]``.

`shard_extents` describes the same rank tensor as byte ranges of the HF tensors (no dtype cast), so a file
converter can copy them straight from the source file into the output file without building the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import torch


class Split(StrEnum):
    REPLICATED = "replicated"
    ROW = "row"
    VOCAB = "vocab"
    QKV = "qkv"
    GATE_UP = "gate_up"


@dataclass(frozen=True)
class Geometry:
    """Model facts the transforms need."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


class TensorSource(Protocol):
    """Read access to Hugging Face tensors by name, optionally only a contiguous range along one dim."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor: ...


class DictSource:
    """A `TensorSource` over an in-memory state dict (tests, live HF models)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self.tensors[name]
        return t.clone() if dim is None else t.narrow(dim, start, (stop or t.shape[dim]) - start).clone()


def rank_shape(split: Split, hf_shapes: list[tuple[int, ...]], tp: int, geo: Geometry) -> tuple[int, ...]:
    """Shape of one TP rank's Megatron tensor built from HF tensors of `hf_shapes`."""
    first = hf_shapes[0]
    if split is Split.REPLICATED:
        return first
    if split is Split.ROW:
        return (first[0], first[1] // tp)
    if split is Split.VOCAB:
        return (geo.padded_vocab_size // tp, *first[1:])
    if split is Split.QKV:
        return (sum(s[0] for s in hf_shapes) // tp, *first[1:])
    if split is Split.GATE_UP:
        return (2 * first[0] // tp, *first[1:])
    raise AssertionError(split)


def _rows(source: TensorSource, name: str, tp: int, rank: int) -> torch.Tensor:
    n = source.shape(name)[0] // tp
    return source.read(name, 0, rank * n, (rank + 1) * n)


def qkv_row_runs(geo: Geometry, tp: int, rank: int) -> list[tuple[int, int, int]]:
    """TP rank `rank`'s rows of the fused QKV tensor as runs (q/k/v index, first row in that HF tensor, rows).

    Megatron's fused QKV interleaves query groups ``[q heads of group g; k_g; v_g]`` and its column-parallel
    linear gives rank r the r-th of `tp` equal row blocks. With KV heads >= TP a block is whole groups; with
    fewer KV heads than TP ranks (megatron-core >= 0.13, ``num_query_groups < tp``) a block is part of a group
    and each rank all-gathers the others' rows at run time, so the same row-block rule holds for both.
    """
    q_rows, kv_rows = geo.heads_per_group * geo.head_dim, geo.head_dim
    per_group = q_rows + 2 * kv_rows
    block = geo.num_kv_heads * per_group // tp
    start, stop = rank * block, (rank + 1) * block
    runs = []
    for g in range(start // per_group, -(-stop // per_group)):
        base = g * per_group
        for idx, (lo, n, first) in enumerate(((0, q_rows, g * q_rows), (q_rows, kv_rows, g * kv_rows),
                                              (q_rows + kv_rows, kv_rows, g * kv_rows))):
            a, b = max(start, base + lo), min(stop, base + lo + n)
            if a < b:
                runs.append((idx, first + a - base - lo, b - a))
    return runs


def _qkv_shard(source: TensorSource, names: tuple[str, ...], tp: int, rank: int, geo: Geometry) -> torch.Tensor:
    parts = [source.read(names[idx], 0, first, first + n) for idx, first, n in qkv_row_runs(geo, tp, rank)]
    return torch.cat(parts, dim=0)


def _vocab_shard(source: TensorSource, name: str, tp: int, rank: int, geo: Geometry) -> torch.Tensor:
    rows = geo.padded_vocab_size // tp
    start, stop = rank * rows, (rank + 1) * rows
    real_stop = min(stop, geo.vocab_size)
    if real_stop <= start:
        sample = source.read(name, 0, 0, 1)
        return torch.zeros((rows, *sample.shape[1:]), dtype=sample.dtype)
    part = source.read(name, 0, start, real_stop)
    if real_stop == stop:
        return part
    out = torch.zeros((rows, *part.shape[1:]), dtype=part.dtype)
    out[: part.shape[0]] = part
    return out


def shard(split: Split, source: TensorSource, names: tuple[str, ...], tp: int, rank: int,
          geo: Geometry) -> torch.Tensor:
    """TP rank `rank`'s Megatron tensor, read slice by slice from the HF tensors `names`."""
    if split is Split.REPLICATED:
        return source.read(names[0])
    if split is Split.ROW:
        n = source.shape(names[0])[1] // tp
        return source.read(names[0], 1, rank * n, (rank + 1) * n)
    if split is Split.VOCAB:
        return _vocab_shard(source, names[0], tp, rank, geo)
    if split is Split.QKV:
        return _qkv_shard(source, names, tp, rank, geo)
    if split is Split.GATE_UP:
        return torch.cat([_rows(source, names[0], tp, rank), _rows(source, names[1], tp, rank)], dim=0)
    raise AssertionError(split)


ZERO = -1
"""`Extent` source index meaning "this many zero bytes" (vocabulary padding)."""

Extent = tuple[int, int, int]
"""(index into the HF names, or ZERO; byte offset inside that HF tensor; length in bytes)."""


def _coalesce(extents: list[Extent]) -> list[Extent]:
    out: list[Extent] = []
    for idx, off, n in extents:
        if n and out and out[-1][0] == idx and (idx == ZERO or out[-1][1] + out[-1][2] == off):
            out[-1] = (idx, out[-1][1], out[-1][2] + n)
        elif n:
            out.append((idx, off, n))
    return out


def shard_extents(split: Split, hf_shapes: list[tuple[int, ...]], itemsize: int, tp: int, rank: int,
                  geo: Geometry) -> list[Extent]:
    """TP rank `rank`'s Megatron tensor as byte ranges of the HF tensors, in output order (same bytes as
    `shard` without a dtype cast; adjacent ranges merged)."""
    first = hf_shapes[0]
    row = int(torch.Size(first[1:]).numel()) * itemsize  # bytes per dim-0 row (itemsize for a bias)
    if split is Split.REPLICATED:
        return [(0, 0, first[0] * row if first else itemsize)]
    if split is Split.ROW:
        cols = first[1] // tp
        return _coalesce([(0, (r * first[1] + rank * cols) * itemsize, cols * itemsize) for r in range(first[0])])
    if split is Split.VOCAB:
        rows = geo.padded_vocab_size // tp
        start = rank * rows
        real = max(0, min(start + rows, geo.vocab_size) - start)
        return _coalesce([(0, start * row, real * row), (ZERO, 0, (rows - real) * row)])
    if split is Split.QKV:
        return _coalesce([(idx, first * row, n * row) for idx, first, n in qkv_row_runs(geo, tp, rank)])
    if split is Split.GATE_UP:
        n = first[0] // tp
        return _coalesce([(0, rank * n * row, n * row), (1, rank * n * row, n * row)])
    raise AssertionError(split)


def merge(split: Split, parts: list[torch.Tensor], names: tuple[str, ...],
          geo: Geometry) -> list[tuple[str, torch.Tensor]]:
    """All TP ranks' Megatron tensors (in rank order) -> the HF tensors `names`, vocab padding stripped."""
    if split is Split.REPLICATED:
        return [(names[0], parts[0])]
    if split is Split.ROW:
        return [(names[0], torch.cat(parts, dim=1))]
    if split is Split.VOCAB:
        return [(names[0], torch.cat(parts, dim=0)[: geo.vocab_size])]
    if split is Split.GATE_UP:
        halves = [p.chunk(2, dim=0) for p in parts]
        return [(names[0], torch.cat([h[0] for h in halves])), (names[1], torch.cat([h[1] for h in halves]))]
    if split is Split.QKV:  # the ranks' row blocks, in order, are the whole interleaved tensor
        full = torch.cat(parts, dim=0)
        rest = tuple(full.shape[1:])
        q_rows, kv_rows = geo.heads_per_group * geo.head_dim, geo.head_dim
        q, k, v = full.view(-1, q_rows + 2 * kv_rows, *rest).split([q_rows, kv_rows, kv_rows], dim=1)
        return [(n, t.reshape(-1, *rest)) for n, t in zip(names, (q, k, v), strict=True)]
    raise AssertionError(split)
