"""MoE routing replay across ranks: each rank fetches the routed experts of exactly the samples it trains on.

A response's routes (int16 ``[prompt + response tokens, MoE layers, top_k]``, ``rollout/routes.py``) stay on the rank
that generated them (the leader of its engine group) or, in async mode, on trainer rank 0, which receives the batch
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

__all__ = ["RoutesMissing", "exchange_routes", "plan_transfers"]

KEY = "routed_experts"


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


def exchange_routes(samples: Sequence[Any], needed: Sequence[int], device: torch.device,
                    group: Any = None) -> int:
    """Give this rank the routes of ``samples[i]`` for every ``i`` in ``needed`` (``sample.extra["routed_experts"]``),
    fetched from the rank that holds them; a collective over ``group`` (the trainer ranks). Returns the bytes this
    rank received. Tensors travel on ``device`` (the group's collective device) as raw bytes: NCCL has no int16."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    mine = _table(samples, needed).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    tables = torch.stack([g.cpu() for g in gathered])
    plan = plan_transfers(tables)
    ops, inbox = [], []
    for (src, dst), indices in sorted(plan.items()):
        if src == me:
            flat = torch.cat([samples[i].extra[KEY].to(torch.int16).reshape(-1) for i in indices])
            ops.append(dist.P2POp(dist.isend, flat.view(torch.uint8).to(device), dist.get_global_rank(group, dst)
                                  if group is not None else dst, group))
        elif dst == me:
            shapes = [tuple(tables[src, 2:, i].tolist()) for i in indices]
            buf = torch.empty(sum(2 * int(torch.Size(s).numel()) for s in shapes), dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, src)
                                  if group is not None else src, group))
            inbox.append((indices, shapes, buf))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    received = 0
    for indices, shapes, buf in inbox:
        flat = buf.cpu().view(torch.int16)
        at = 0
        for i, shape in zip(indices, shapes, strict=True):
            n = int(torch.Size(shape).numel())
            samples[i].extra[KEY] = flat[at:at + n].reshape(shape).clone()
            at += n
        received += buf.numel()
    return received
