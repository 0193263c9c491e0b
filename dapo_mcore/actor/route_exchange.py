"""MoE routing replay across ranks: each rank fetches the routed experts of exactly the samples it trains on.

A response's routes (int16 ``[prompt + response tokens, MoE layers, top_k]``, ``rollout/correction/routes.py``) stay
on the rank that generated them (the leader of its engine group) or, in async mode, on trainer rank 0, which receives
the batch
from the engines: they never travel with the shared batch. At the 30B-A3B recipe's shape (48 MoE layers, top-8) they
cost 768 bytes a token, 3x the batch's token ids and log-probs, and a data-parallel rank replays only its own
micro-batches. :func:`exchange_routes` makes one small all-gather (which rank holds and which rank needs each sample's
routes, and their shape) and then one point-to-point message per (holder, consumer) pair that has anything to move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RoutesMissing", "exchange_routes", "plan_transfers"]

KEY = "routed_experts"


UNKNOWN = -1
"""A position whose route was not recorded (padding, the last sampled token)."""


class RoutesMissing(RuntimeError):
    """A sample some rank trains on has no routes anywhere (an engine or path that does not record them)."""


def _table(samples: Sequence[Any], needed: Sequence[int]) -> torch.Tensor:
    """int64 ``[5, n]``: has the routes, needs them, their shape (3 dims, 0 without routes)."""
    t = torch.zeros(5, len(samples), dtype=torch.int64)
    for i, s in enumerate(samples):
        r = s.extra.get(KEY)
        if r is not None:
            t[0, i] = 1
            t[2:, i] = torch.tensor(tuple(r.shape), dtype=torch.int64)
    t[1, list(needed)] = 1
    return t


def plan_transfers(tables: torch.Tensor) -> dict[tuple[int, int], list[int]]:
    """``{(holder, consumer): sample indices}`` from every rank's table (``[world, 5, n]``): each sample a rank needs
    and does not hold comes from the lowest rank that holds it. Raises RoutesMissing (on every rank alike)."""
    have, need = tables[:, 0].bool(), tables[:, 1].bool()
    missing = (need.any(dim=0) & ~have.any(dim=0)).nonzero().flatten().tolist()
    if missing:
        raise RoutesMissing(f"algo.router_replay=rollout but {len(missing)} rollouts carry no routed experts "
                            f"(sample {missing[0]} first; an engine or path that does not record them); "
                            f"set algo.router_replay=none.")
    owner = have.int().argmax(dim=0).tolist()
    plan: dict[tuple[int, int], list[int]] = {}
    for rank, row in enumerate((need & ~have).tolist()):
        for i, wanted in enumerate(row):
            if wanted:
                plan.setdefault((owner[i], rank), []).append(i)
    return plan


def exchange_routes(samples: Sequence[Any], needed: Sequence[int], device: Any,
                    group: Any = None) -> int:
    """Give this rank the routes of ``samples[i]`` for every ``i`` in ``needed`` (``sample.extra["routed_experts"]``),
    fetched from the rank that holds them; a collective over ``group`` (the trainer ranks). Returns the bytes this
    rank received. Tensors travel on ``device`` (``collectives.device.collective_device``: its ``to``/``empty``/``host``) as
    raw bytes: NCCL has no int16."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    table = _table(samples, needed)
    mine = device.to(table.reshape(-1))  # flat: a view of a tensor on the device is not marked as on it
    gathered = [device.empty(table.numel(), table.dtype) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    tables = torch.stack([device.host(g).view(table.shape) for g in gathered])
    plan = plan_transfers(tables)
    ops, inbox = [], []
    for (src, dst), indices in sorted(plan.items()):
        if src == me:
            flat = torch.cat([samples[i].extra[KEY].to(torch.int16).reshape(-1) for i in indices])
            ops.append(dist.P2POp(dist.isend, device.to(flat.view(torch.uint8)), dist.get_global_rank(group, dst)
                                  if group is not None else dst, group))
        elif dst == me:
            shapes = [tuple(tables[src, 2:, i].tolist()) for i in indices]
            buf = device.empty(sum(2 * int(torch.Size(s).numel()) for s in shapes), torch.uint8)
            ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, src)
                                  if group is not None else src, group))
            inbox.append((indices, shapes, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    received = 0
    for indices, shapes, buf in inbox:
        flat = device.host(buf).view(torch.int16)
        at = 0
        for i, shape in zip(indices, shapes, strict=True):
            n = int(torch.Size(shape).numel())
            samples[i].extra[KEY] = flat[at:at + n].reshape(shape).clone()
            at += n
        received += buf.numel()
    return received


def align_routes(routes: list[Tensor], width: int, packed: bool, top_k: int, rows: int = 0) -> tuple[Tensor, Tensor]:
    """One micro-batch's routes laid out like its tokens: rows ``[B, width, L, k]`` (row i from 0; B at least
    ``rows``: a micro-batch padded with rows of padding) or packed ``[1, width, L, k]`` (sequences one after
    another), and where a route was recorded (``[B or 1, width]``). Positions without one (padding, a last token)
    get experts ``0..k-1``: replay needs some valid experts there, and nothing the loss reads depends on them."""
    layers = routes[0].shape[1]
    out = torch.full((1 if packed else max(len(routes), rows), width, layers, top_k), UNKNOWN, dtype=torch.long)
    offset = 0
    for i, r in enumerate(routes):
        row, start = (0, offset) if packed else (i, 0)
        out[row, start:start + r.shape[0]] = r.long()
        offset += r.shape[0]
    known = (out >= 0).all(dim=-1).all(dim=-1)
    filler = torch.arange(top_k).expand_as(out)
    return torch.where(out >= 0, out, filler), known
