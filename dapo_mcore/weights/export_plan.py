"""Where each TP rank's Megatron tensor lands in the full Hugging Face tensors: the export's copy plan.

The streaming export (`export.iter_hf_weights`) builds every HF tensor once, in its final buffer: each rank
copies its own rows there and the other ranks' rows are received straight into their places, so no gathered
buffer is merged (copied) a second time. This module says which rows go where, per kind of split:

* ``vocab``: rank r's rows are HF rows ``[r * R, (r + 1) * R)``, cut at the real vocabulary (padding is
  neither sent nor kept);
* ``gate_up``: rank r's ``[gate_r; up_r]`` are row block r of ``gate`` and of ``up``;
* ``qkv``: rank r's row block of the interleaved groups is one contiguous row range of each of q, k and v
  (`transforms.qkv_row_runs`), made of one run per query group it holds;
* ``replicated``: every rank holds the whole tensor; the export keeps TP rank 0's (one transfer);
* ``row``: rank r's tensor is HF column block r, which is not a row range: it is received into a staging
  buffer and copied into its columns (``CopyPlan.columns``).

A plan depends only on (split, HF shapes, TP size, geometry), all values, so `copy_plan` is cached on them:
a plan cannot be reused for another layout or model, and each placement's plan is built once per process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dapo_mcore.weights.transforms import Geometry, Split, qkv_row_runs


@dataclass(frozen=True)
class Run:
    """``rows`` rows of one rank's Megatron tensor, from row ``src`` on, are rows ``dst`` on of HF tensor ``out``."""

    rank: int
    out: int
    dst: int
    src: int
    rows: int


@dataclass(frozen=True)
class Send:
    """One transfer: rank ``rank``'s rows ``[dst, dst + rows)`` of HF tensor ``out``, in every rank's buffer.

    ``src`` is the first row of those rows in the sender's Megatron tensor when they are contiguous there (it
    can send them before its own copy), else -1 (it sends them from the HF tensor after its copy).
    """

    rank: int
    out: int
    dst: int
    rows: int
    src: int


@dataclass(frozen=True)
class CopyPlan:
    tp: int
    shapes: tuple[tuple[int, ...], ...]
    """The HF tensors of the placement, in the order of its HF names."""
    runs: tuple[tuple[Run, ...], ...]
    """Each rank's rows, indexed by rank (no runs for ``columns``)."""
    sends: tuple[Send, ...]
    """The transfers, in the order every rank issues them."""
    columns: bool
    """ROW split: rank r's tensor is columns ``[r * c, (r + 1) * c)`` of the single HF tensor."""


@functools.lru_cache(maxsize=1024)
def copy_plan(split: Split, hf_shapes: tuple[tuple[int, ...], ...], tp: int, geo: Geometry) -> CopyPlan:
    """The copy plan of one placement: `hf_shapes` as `ModelMapping.hf_output_shapes` gives them."""
    if split is Split.ROW:
        sends = tuple(Send(r, 0, 0, hf_shapes[0][0], 0) for r in range(tp))
        return CopyPlan(tp, hf_shapes, ((),) * tp, sends, True)
    runs = _runs(split, hf_shapes, tp, geo)
    by_rank = tuple(tuple(run for run in runs if run.rank == r) for r in range(tp))
    return CopyPlan(tp, hf_shapes, by_rank, _sends(runs), False)


def _runs(split: Split, hf_shapes: tuple[tuple[int, ...], ...], tp: int, geo: Geometry) -> tuple[Run, ...]:
    rows = hf_shapes[0][0]
    if split is Split.REPLICATED:
        return (Run(0, 0, 0, 0, rows),)
    if split is Split.VOCAB:
        per = geo.padded_vocab_size // tp
        return tuple(Run(r, 0, r * per, 0, min(per, geo.vocab_size - r * per))
                     for r in range(tp) if r * per < geo.vocab_size)
    if split is Split.GATE_UP:
        n = rows // tp
        return tuple(Run(r, i, r * n, i * n, n) for r in range(tp) for i in (0, 1))
    if split is Split.QKV:
        out: list[Run] = []
        for r in range(tp):
            src = 0
            for idx, first, n in qkv_row_runs(geo, tp, r):
                out.append(Run(r, idx, first, src, n))
                src += n
        return tuple(out)
    raise AssertionError(split)


def _sends(runs: tuple[Run, ...]) -> tuple[Send, ...]:
    """One send per (rank, HF tensor): a rank's runs of one HF tensor are one contiguous HF row range."""
    sends: dict[tuple[int, int], Send] = {}
    for run in runs:
        prev = sends.get((run.rank, run.out))
        if prev is None:
            sends[run.rank, run.out] = Send(run.rank, run.out, run.dst, run.rows, run.src)
            continue
        assert prev.dst + prev.rows == run.dst, (prev, run)
        src = prev.src if prev.src >= 0 and prev.src + prev.rows == run.src else -1
        sends[run.rank, run.out] = Send(run.rank, run.out, prev.dst, prev.rows + run.rows, src)
    return tuple(sends.values())


def column_block(out: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s column block of a ROW-split HF tensor (a strided view of ``out``)."""
    return out.view(out.shape[0], tp, -1)[:, rank]


def copy_runs(plan: CopyPlan, rank: int, local: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copy rank ``rank``'s Megatron tensor ``local`` into its places in the HF tensors ``outs``."""
    if plan.columns:
        column_block(outs[0], plan.tp, rank).copy_(local)
        return
    for run in plan.runs[rank]:
        outs[run.out][run.dst:run.dst + run.rows].copy_(local[run.src:run.src + run.rows])


def assemble(plan: CopyPlan, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The HF tensors from all ranks' tensors, on one process: what every rank of the export ends up with."""
    outs = [torch.empty(s, dtype=parts[0].dtype) for s in plan.shapes]
    for rank, part in enumerate(parts):
        copy_runs(plan, rank, part, outs)
    return outs
