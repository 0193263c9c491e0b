"""Streaming over several engine groups: one stream, one decision per step, the same on every rank.

Each engine group streams its own share of a chunk's prompts (round robin: prompt ``i`` goes to group
``i % groups``, so every group holds early prompts). The groups advance in lockstep, ``exchange_every`` decode steps
at a time, and after each tick every group's leader broadcasts the groups that ended in it (``gather.exchange_shares``:
one all-gather a tick, then only the non-empty shares).
Every rank then holds the same finished groups at the same tick, and the scheduler decides on them in prompt order,
exactly as with one engine. Where a stream stands at an exchange depends on the seed and the decode steps taken, not
on which engine is faster, so the whole step (kept, rejected, surplus, aborted, buffered) is a pure function of the
seed, the data, the world size and ``rollout.schedule.exchange_every``.

An abort reaches every rank at the same tick (it follows from shared data): each group aborts its own stream, the
aborted token counts are summed over the leaders, and with partial rollouts the groups in flight are exchanged so that
every rank buffers the same ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.collectives.device import collective_device as strict_device
from dapo_mcore.rollout.protocol import PartialGroup, Response
from dapo_mcore.rollout.scheduling.gather import exchange_shares

__all__ = ["EngineGroups", "EngineGroupStream", "ExchangeTally", "round_robin"]


@dataclass
class EngineGroups:
    """How this rank takes part in generation: ``count`` engine groups split each call; this rank is in group
    ``index`` and sends the group's responses when ``leader`` (the transformers engine: one rank a group; vLLM: the
    ranks of one tensor-parallel engine)."""

    count: int = 1
    index: int = 0
    leader: bool = True
    routes_to: int | None = None
    """MoE routing replay: the rank of this side's process group that must hold every group's routed experts (the
    async engines' rank 0, which sends the batch to the trainer); None where each trainer rank fetches its own."""

    def seed(self, seed: int | None) -> int:
        """This group's share of a call seeded ``seed``: each group draws its own samples."""
        return (seed or 0) + 1_000_003 * self.index


@dataclass
class ExchangeTally:
    """Exchanges between engine groups, and the wall seconds they took (waiting for the slowest group included)."""

    count: int = 0
    seconds: float = 0.0


def round_robin(num_items: int, groups: EngineGroups) -> list[int]:
    """The positions (of ``num_items``) this engine group serves."""
    return list(range(groups.index, num_items, groups.count))


def _sum_over_ranks(values: list[int]) -> list[int]:
    device = strict_device()
    t = device.to(torch.tensor(values, dtype=torch.int64))
    dist.all_reduce(t)
    return [int(x) for x in device.host(t).tolist()]


class EngineGroupStream:
    """A streamed generation call over every engine group (see module docstring).

    Args:
        local: this group's engine stream (``ticks()``, ``abort``, ``partials``), or None when it serves no prompt.
        positions: the chunk position of each of ``local``'s prompts.
        groups: the engine-group layout.
        exchange_every: decode steps between two exchanges.
        tally: where the exchanges are counted (the caller's running total).
    """

    def __init__(self, local: Any, positions: list[int], groups: EngineGroups, exchange_every: int,
                 tally: ExchangeTally | None = None) -> None:
        self.local, self.positions, self.groups, self.every = local, positions, groups, exchange_every
        self._ticks = local.ticks() if local is not None else iter(())
        self._exhausted = local is None
        self._unclaimed: dict[int, list[Response]] = {}
        self._partials: list[PartialGroup] = []
        self.tally = tally if tally is not None else ExchangeTally()
        """Each exchange: one size all-gather (with the still-running flags), then the broadcasts of non-empty shares."""

    def ticks(self) -> Iterator[list[tuple[int, list[Response]]]]:
        """Per exchange, the groups that ended on any engine since the last one, in prompt order (the same list on
        every rank). A group is pending until ``claim``ed: an abort counts the unclaimed ones as in flight."""
        while True:
            mine: list[tuple[int, list[Response]]] = []
            for _ in range(self.every):
                if self._exhausted:
                    break
                try:
                    mine.extend(next(self._ticks))
                except StopIteration:
                    self._exhausted = True
            start = time.perf_counter()
            # one all-gather carries every leader's share sizes and whether its engine still runs; only non-empty
            # shares are broadcast after it: a tick where nothing ended anywhere is that one collective
            shares, running = exchange_shares([self.positions[i] for i, _ in mine], [r for _, r in mine],
                                              sender=self.groups.leader, flag=not self._exhausted,
                                              routes_to=self.groups.routes_to)
            self.tally.count += 1
            self.tally.seconds += time.perf_counter() - start
            ended = sorted((pos, rs) for share in shares for pos, rs in share.items())
            self._unclaimed.update(ended)
            if ended:
                yield ended
            if not running:
                return

    def claim(self, position: int) -> None:
        """The consumer took this ended group (it is generated, not in flight)."""
        del self._unclaimed[position]

    def abort(self, keep_partial: bool = False) -> int:
        """Every group stops (a collective: all ranks abort at the same tick). Returns the tokens dropped over all
        groups; with ``keep_partial`` the groups in flight are kept for ``partials()`` instead (every rank the same)."""
        local = 0 if self.local is None else self.local.abort(keep_partial=True) if keep_partial else self.local.abort()
        unclaimed = sorted(self._unclaimed.items())
        self._unclaimed = {}
        if keep_partial:
            mine = [] if self.local is None or not self.groups.leader else self.local.partials()
            self._partials = self._exchange_partials(mine) + [
                PartialGroup(pos, rs, [True] * len(rs)) for pos, rs in unclaimed]
            self._partials.sort(key=lambda p: p.index)
            return 0
        dropped = _sum_over_ranks([local if self.groups.leader else 0])[0]
        return dropped + sum(r.length for _, rs in unclaimed for r in rs)

    def partials(self) -> list[PartialGroup]:
        """After ``abort(keep_partial=True)``: every engine group's groups in flight, in prompt order."""
        return list(self._partials)

    def _exchange_partials(self, mine: list[PartialGroup]) -> list[PartialGroup]:
        """The leaders' in-flight groups on every rank, once per abort: packed into one int64 tensor each (log-probs
        as their float64 bits) and all-gathered on a gloo group, so nothing of it passes through GPU memory (a
        pickle through NCCL would, gigabytes at a 32B step's partials, while vLLM holds the GPU)."""
        from dapo_mcore.collectives.packed import all_gather_packed

        ints = pack_partials([(self.positions[p.index], p) for p in mine])
        gathered = all_gather_packed(ints, torch.zeros(0), group=host_group())
        return [group for got, _ in gathered for group in unpack_partials(got)]


_FINISH = ("stop", "length")
_HOST_GROUPS: dict[int, Any] = {}


def host_group() -> Any:
    """A gloo group over the default group's ranks (made once per default group, by every rank at the same point:
    the first abort that keeps partials, a collective over all of them)."""
    world = dist.group.WORLD
    if id(world) not in _HOST_GROUPS:
        _HOST_GROUPS.clear()  # a new default group (a test's next world): the old groups went with it
        _HOST_GROUPS[id(world)] = (world, dist.new_group(backend="gloo"))
    return _HOST_GROUPS[id(world)][1]


def pack_partials(groups: list[tuple[int, PartialGroup]]) -> torch.Tensor:
    """``(position, group)`` pairs as one int64 tensor: count, then per group its position, response count, done
    flags and per response its finish reason, token and log-prob counts, tokens and log-probs (float64 bits: exact)."""
    out: list[torch.Tensor] = [torch.tensor([len(groups)], dtype=torch.int64)]
    for pos, g in groups:
        out.append(torch.tensor([pos, len(g.responses), *map(int, g.done)], dtype=torch.int64))
        for r in g.responses:
            out.append(torch.tensor([_FINISH.index(r.finish_reason), len(r.token_ids), len(r.logprobs),
                                     *r.token_ids], dtype=torch.int64))
            out.append(torch.tensor(r.logprobs, dtype=torch.float64).view(torch.int64))
    return torch.cat(out)


def unpack_partials(ints: torch.Tensor) -> list[PartialGroup]:
    """Inverse of :func:`pack_partials` (groups with their positions as ``index``)."""
    values, floats = ints.tolist(), ints.view(torch.float64).tolist()
    out, at = [], 1
    for _ in range(values[0]):
        pos, count = values[at], values[at + 1]
        done = [bool(x) for x in values[at + 2:at + 2 + count]]
        at += 2 + count
        responses = []
        for _ in range(count):
            finish, n, m = values[at:at + 3]
            tokens = values[at + 3:at + 3 + n]
            at += 3 + n
            responses.append(Response(tokens, floats[at:at + m], _FINISH[finish]))  # type: ignore[arg-type]
            at += m
        out.append(PartialGroup(pos, responses, done))
    return out
