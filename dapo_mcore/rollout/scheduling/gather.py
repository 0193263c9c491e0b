"""Split a generation batch over engine groups, share the responses, and score each response exactly once.

* :func:`plan_shares`: which prompts (and how many samples of each) every engine group generates. Every group
  always has work, or a placeholder, because vLLM's data-parallel engines step together: a group that never
  calls ``generate()`` leaves the others waiting in a collective forever.
* :func:`broadcast_shares`: the responses of each engine group, from ONE rank of that group (its TP peers hold the
  same), to every rank's host memory. Each share travels as one int64 tensor (prompt index, response count, and
  per response: finish reason, token count, log-prob count, token ids) and one float32 tensor (the log-probs),
  broadcast from its sender in chunks of bounded size: at paper scale a step holds ~25k responses of up to 20k
  tokens, and the device only ever holds one chunk of it while vLLM keeps its memory.
* :func:`apply_once`: a function (the verifier) applied to each item on exactly one rank, the verdicts shared, so
  every rank provably holds the same batch even if the function is not deterministic (timeouts, custom rewards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dapo_mcore.collectives.device import collective_device
from dapo_mcore.collectives.packed import all_gather_packed
from dapo_mcore.errors import UserError
from dapo_mcore.rollout.protocol import EngineError, Response

_FINISH = ("stop", "length")
T = TypeVar("T")
R = TypeVar("R")

CHUNK_ELEMS = 8 << 20  # elements per broadcast chunk: 64 MiB of int64 on the device at a time


@dataclass(frozen=True)
class Share:
    """What one engine group generates: ``n`` samples of each prompt in ``indices``."""

    indices: list[int]
    n: int

    @property
    def idle(self) -> bool:
        """Nothing to generate (fewer samples than groups): the group runs a placeholder to stay in step."""
        return not self.indices


def plan_shares(num_prompts: int, n: int, groups: int) -> list[Share]:
    """Every engine group's share of ``num_prompts`` prompts with ``n`` samples each.

    With at least as many prompts as groups, group g takes prompts g, g + groups, ... with all n samples. With fewer,
    the groups split the samples instead: the groups g = p, p + num_prompts, ... share prompt p's n samples as
    evenly as possible (a group left with none is idle). Each prompt's samples come back in group order.
    """
    if num_prompts >= groups:
        return [Share(list(range(g, num_prompts, groups)), n) for g in range(groups)]
    shares = []
    for g in range(groups):
        p = g % num_prompts
        helpers = len(range(p, groups, num_prompts))
        k = g // num_prompts
        count = n // helpers + (1 if k < n % helpers else 0)
        shares.append(Share([p] if count else [], count))
    return shares


def pack_responses(indices: Sequence[int], results: Sequence[Sequence[Response]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ints, floats) holding ``results[j]`` (the responses of prompt ``indices[j]``)."""
    ints: list[int] = [len(indices)]
    floats: list[float] = []
    for index, responses in zip(indices, results, strict=True):
        ints += [index, len(responses)]
        for r in responses:
            mask = r.loss_mask is not None  # multi-turn: which tokens are the model's, and the tool counts
            ints += [_FINISH.index(r.finish_reason), len(r.token_ids), len(r.logprobs), int(mask), r.tool_calls,
                     r.tool_errors]
            ints += list(r.token_ids)
            ints += [int(m) for m in r.loss_mask] if mask else []
            floats += list(r.logprobs)
    return torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float32)


def unpack_responses(ints: torch.Tensor, floats: torch.Tensor) -> dict[int, list[Response]]:
    """Inverse of :func:`pack_responses` (trailing padding is ignored)."""
    iv, fv = ints.tolist(), floats.tolist()
    out: dict[int, list[Response]] = {}
    pos, fpos = 1, 0
    for _ in range(iv[0]):
        index, count = iv[pos], iv[pos + 1]
        pos += 2
        responses = []
        for _ in range(count):
            finish, n_tok, n_lp, has_mask, calls, errors = iv[pos:pos + 6]
            pos += 6
            ids = iv[pos:pos + n_tok]
            pos += n_tok
            mask = [bool(m) for m in iv[pos:pos + n_tok]] if has_mask else None
            pos += n_tok if has_mask else 0
            responses.append(Response(token_ids=ids, logprobs=fv[fpos:fpos + n_lp], finish_reason=_FINISH[finish],
                                      loss_mask=mask, tool_calls=calls, tool_errors=errors))  # type: ignore[arg-type]
            fpos += n_lp
        out[index] = responses
    return out


def all_gather_responses(indices: Sequence[int], results: Sequence[Sequence[Response]]) -> dict[int, list[Response]]:
    """Every rank's (prompt index -> responses), merged, on every rank (a collective over the default group)."""
    merged: dict[int, list[Response]] = {}
    for ints, floats in all_gather_packed(*pack_responses(indices, results)):
        merged.update(unpack_responses(ints, floats))
    return merged


def _broadcast_chunked(flat: torch.Tensor | None, numel: int, dtype: torch.dtype, src: int, device: Any,
                       chunk: int) -> torch.Tensor:
    """``flat`` (on rank ``src``) on every rank's CPU, moved through the collective device ``chunk`` elements at a
    time."""
    out = flat if flat is not None else torch.empty(numel, dtype=dtype)
    for start in range(0, numel, chunk):
        part = device.empty(min(chunk, numel - start), dtype)
        if flat is not None:
            part.copy_(flat[start:start + part.numel()])
        dist.broadcast(part, src=src)
        if flat is None:
            out[start:start + part.numel()] = device.host(part)
    return out


def broadcast_shares(indices: Sequence[int], results: Sequence[Sequence[Response]], sender: bool,
                     chunk_elems: int = CHUNK_ELEMS, routes_to: int | None = None) -> list[dict[int, list[Response]]]:
    """Every sender's (prompt index -> responses), in rank order, on every rank (collective, default group).

    Only ranks with ``sender=True`` contribute (one per engine group): a non-sender's share is not sent at all, so
    the TP peers of an engine group add no copies. Data reaches the host in chunks of ``chunk_elems`` elements.
    Routed experts (MoE routing replay) stay with their sender, and also reach rank ``routes_to`` when given (the
    async engines' rank 0, which sends the whole batch to the trainer).
    """
    return exchange_shares(indices, results, sender, False, chunk_elems, routes_to)[0]


def exchange_shares(indices: Sequence[int], results: Sequence[Sequence[Response]], sender: bool, flag: bool,
                    chunk_elems: int = CHUNK_ELEMS, routes_to: int | None = None
                    ) -> tuple[list[dict[int, list[Response]]], int]:
    """``broadcast_shares`` and how many ranks raised ``flag`` (e.g. "my engine still runs"), in the same size
    all-gather: a streamed tick whose groups are all still running costs that one collective (an empty share is
    not broadcast)."""
    device = collective_device()
    if sender and len(indices):
        ints, floats = pack_responses(indices, results)
    else:  # nothing to send: its share is empty on every rank without a broadcast
        ints, floats = torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    sizes = device.to(torch.tensor([int(sender), ints.numel(), floats.numel(), int(flag)], dtype=torch.int64))
    all_sizes = [device.empty(4, torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(all_sizes, sizes)
    me = dist.get_rank()
    out = []
    table = [device.host(s).tolist() for s in all_sizes]
    flagged = sum(row[3] for row in table)
    for src, (is_sender, n_int, n_float, _) in enumerate(table):
        if not is_sender:
            continue
        if n_int == 0:
            out.append({})
            continue
        got_i = _broadcast_chunked(ints if src == me else None, n_int, torch.int64, src, device, chunk_elems)
        got_f = _broadcast_chunked(floats if src == me else None, n_float, torch.float32, src, device, chunk_elems)
        share = unpack_responses(got_i, got_f)
        if src == me:
            _keep_routes(share, indices, results)
        if routes_to is not None and src != routes_to and me in (src, routes_to):
            _route_to(share, src, routes_to, device)
        out.append(share)
    return out, flagged


def _route_to(share: dict[int, list[Response]], src: int, dst: int, device: Any) -> None:
    """The routes of ``share`` from rank ``src`` (which holds them) to rank ``dst``: a header of their shapes, then
    their int16 values as bytes (NCCL has no int16)."""
    responses = [r for rs in share.values() for r in rs]
    if dist.get_rank() == src:
        shapes = [tuple(r.routed_experts.shape) if r.routed_experts is not None else (0, 0, 0) for r in responses]
        header = device.to(torch.tensor([x for s in shapes for x in s], dtype=torch.int64))
        flat = [r.routed_experts.to(torch.int16).reshape(-1) for r in responses if r.routed_experts is not None]
        data = device.to((torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int16)).view(torch.uint8))
        if header.numel():
            dist.send(header, dst)
        if data.numel():
            dist.send(data, dst)
        return
    header = device.empty(3 * len(responses), torch.int64)
    if header.numel():
        dist.recv(header, src)
    shapes = device.host(header).view(-1, 3).tolist()
    data = device.empty(2 * sum(a * b * c for a, b, c in shapes), torch.uint8)
    if data.numel():
        dist.recv(data, src)
    table, at = device.host(data).view(torch.int16), 0
    for r, (a, b, c) in zip(responses, shapes, strict=True):
        if a:
            r.routed_experts = table[at:at + a * b * c].reshape(a, b, c).clone()
            at += a * b * c


def _keep_routes(share: dict[int, list[Response]], indices: Sequence[int],
                 results: Sequence[Sequence[Response]]) -> None:
    """The sender's own copy of its share keeps its routed experts (MoE routing replay). Routes never travel with a
    share: at the 30B-A3B recipe's shape they cost ~768 B a token, and a data-parallel rank needs only those of the
    samples it trains on, which the actor fetches from the rank that holds them (``actor.route_exchange``)."""
    for index, responses in zip(indices, results, strict=True):
        for got, mine in zip(share[index], responses, strict=True):
            got.routed_experts = mine.routed_experts


def merge_shares(shares: Sequence[dict[int, list[Response]]], num_prompts: int, n: int) -> list[list[Response]]:
    """Each prompt's responses, concatenated over the shares in order; every prompt must end up with ``n``."""
    merged: list[list[Response]] = [[] for _ in range(num_prompts)]
    for share in shares:
        for index, responses in share.items():
            merged[index].extend(responses)
    short = [i for i, m in enumerate(merged) if len(m) != n]
    if short:
        raise EngineError(f"after gathering the engine groups' shares, prompt {short[0]} has "
                          f"{len(merged[short[0]])} responses, not {n} ({len(short)} prompts affected)")
    return merged


def apply_once(fn: Callable[[list[T]], list[R]], items: Sequence[T]) -> list[R]:
    """``fn(items)`` on every rank, each item computed on exactly one rank (its strided share) and shared.

    Every rank gets the same list whatever ``fn`` does on each rank: one verdict per item, not one per rank.
    A collective over the default group when one is initialized (the verdicts travel pickled; they are small).
    A user error raised by ``fn`` on one rank (a reward that fails too often, a NaN reward) is raised on every rank,
    so none of them waits for the others' verdicts.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(fn(list(items)))
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = list(range(rank, len(items), world))
    error: UserError | None = None
    try:
        local = list(fn([items[i] for i in mine])) if mine else []
    except UserError as exc:
        local, error = [], exc
    if error is None and len(local) != len(mine):
        raise ValueError(f"the function returned {len(local)} results for {len(mine)} items")
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, (error, local))
    first = next((e for e, _ in everything if e is not None), None)
    if first is not None:
        raise first
    out: list[Any] = [None] * len(items)
    for r, (_, part) in enumerate(everything):
        out[r::world] = part
    return out
