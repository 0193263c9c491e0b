"""How a step's batch (or an evaluation) travels in async mode: its tokens and log-probs as two flat tensors.

A message from the engines (``rollout.pipeline.async_engines``) holds every response of the step: pickled as Python
lists that is ~5 bytes a token id and 9 a log-prob, plus pickle's per-item framing. Here the responses' token ids
travel as one int32 tensor and their log-probs as one float32 tensor (what the engines computed them in), and only the
rest (records, scores, counts, each response's lengths and finish reason, and with tool use its loss mask as run
lengths and its tool counts) is pickled. ``benchmarks/bridge_bytes.py``
measures both at the 32B recipe's shape.

A group that appears twice in a message (a kept group is also among the generated ones) travels once and is one
object again on arrival, as pickle would have it.

MoE routing replay: a response's routed experts (int16 ``[tokens, MoE layers, top_k]``) travel as the raw bytes of
one flat tensor (``routes=True``, the engines' batch to trainer rank 0), or not at all (``routes=False``, trainer
rank 0 to the other trainer ranks: each fetches only the routes of the samples it trains on,
``actor.route_exchange``).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch

from dapo_mcore.rollout.pipeline.source import StepBatch
from dapo_mcore.rollout.protocol import Response
from dapo_mcore.rollout.scheduling.groups import GroupData

__all__ = ["Packed", "light", "pack", "unpack"]


@dataclasses.dataclass
class Packed:
    """A message without its responses' tokens: the pickled rest and the two flat tensors."""

    meta: bytes
    token_ids: torch.Tensor
    """int32, every response's token ids, in order."""
    logprobs: torch.Tensor
    """float32, every response's log-probs, in order."""
    routes: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.uint8))
    """uint8, the bytes of every carried response's int16 routed experts, in order (empty without routes)."""

    @property
    def nbytes(self) -> int:
        return len(self.meta) + self.token_ids.numel() * 4 + self.logprobs.numel() * 4 + self.routes.numel()


def _groups(message: dict[str, Any]) -> list[GroupData]:
    """The message's groups, each once, in a fixed order (a batch's generated then kept; an evaluation's)."""
    batch = message.get("batch")
    found = ([*batch.generated, *batch.kept] if batch is not None else []) + list(message.get("groups") or [])
    seen: dict[int, GroupData] = {}
    for g in found:
        seen.setdefault(id(g), g)
    return list(seen.values())


def _with_groups(message: dict[str, Any], swap: dict[int, GroupData]) -> dict[str, Any]:
    out = dict(message)
    batch = message.get("batch")
    if batch is not None:
        out["batch"] = dataclasses.replace(batch, kept=[swap[id(g)] for g in batch.kept],
                                           generated=[swap[id(g)] for g in batch.generated])
    if message.get("groups") is not None:
        out["groups"] = [swap[id(g)] for g in message["groups"]]
    return out


def _route_shape(r: Response, routes: bool) -> tuple[int, ...] | None:
    return tuple(r.routed_experts.shape) if routes and r.routed_experts is not None else None


def _tool_columns(r: Response) -> tuple[int, int, list[int]] | None:
    """Multi-turn tool use: (tool_calls, tool_errors, the loss mask as run lengths, alternately True and False from
    a True run, which may be empty); None for a response without a loss mask."""
    if r.loss_mask is None:
        return None
    runs, value, n = [], True, 0
    for m in r.loss_mask:
        if bool(m) != value:
            runs.append(n)
            value, n = not value, 0
        n += 1
    runs.append(n)
    return r.tool_calls, r.tool_errors, runs


def _tool_fields(columns: tuple[int, int, list[int]] | None) -> dict[str, Any]:
    if columns is None:
        return {}
    calls, errors, runs = columns
    mask = [k % 2 == 0 for k, n in enumerate(runs) for _ in range(n)]
    return {"loss_mask": mask, "tool_calls": calls, "tool_errors": errors}


def pack(message: dict[str, Any], routes: bool = True) -> Packed:
    """``message`` (a batch, an evaluation or an error) as a Packed; its routed experts only with ``routes``."""
    groups = _groups(message)
    ids: list[int] = []
    lps: list[float] = []
    tables: list[torch.Tensor] = []
    shapes, swap = [], {}
    for g in groups:
        shapes.append([(len(r.token_ids), len(r.logprobs), r.finish_reason, r.stale_tokens, _route_shape(r, routes),
                        r.versions, _tool_columns(r)) for r in g.responses])
        for r in g.responses:
            ids += r.token_ids
            lps += r.logprobs
            if _route_shape(r, routes) is not None:
                tables.append(torch.as_tensor(r.routed_experts).to(torch.int16).reshape(-1))
        swap[id(g)] = dataclasses.replace(g, responses=[])
    meta = pickle.dumps({"message": _with_groups(message, swap), "shapes": shapes})
    flat = torch.cat(tables) if tables else torch.zeros(0, dtype=torch.int16)
    return Packed(meta, torch.tensor(ids, dtype=torch.int32), torch.tensor(lps, dtype=torch.float32),
                  flat.view(torch.uint8))


def unpack(packed: Packed) -> dict[str, Any]:
    """The message ``pack`` was given (log-probs rounded to float32, which is what the engines computed)."""
    meta = pickle.loads(packed.meta)
    message, shapes = meta["message"], meta["shapes"]
    ids, lps = packed.token_ids.tolist(), packed.logprobs.tolist()
    table = packed.routes.contiguous().view(torch.int16)
    at_id = at_lp = at_route = 0
    for g, shape in zip(_groups(message), shapes, strict=True):
        for n_ids, n_lps, finish, stale, route_shape, versions, *tools in shape:  # no tools: a message from before
            routed = None
            if route_shape is not None:
                n = int(torch.Size(route_shape).numel())
                routed = table[at_route:at_route + n].reshape(route_shape).clone()
                at_route += n
            g.responses.append(Response(ids[at_id:at_id + n_ids], lps[at_lp:at_lp + n_lps], finish, stale, routed,
                                        versions, **_tool_fields(tools[0] if tools else None)))
            at_id, at_lp = at_id + n_ids, at_lp + n_lps
    if (at_id, at_lp, at_route) != (len(ids), len(lps), table.numel()):
        raise ValueError(f"a packed message holds {len(ids)} token ids, {len(lps)} log-probs and {table.numel()} "
                         f"routes, its groups {at_id}, {at_lp} and {at_route}")
    return message


def light(message: dict[str, Any]) -> dict[str, Any]:
    """A batch message as the trainer ranks other than rank 0 need it: the kept groups whole, the other generated
    groups without responses (they are counted on every rank, logged and stored on rank 0 only)."""
    batch: StepBatch | None = message.get("batch")
    if batch is None:
        return message
    kept = {id(g) for g in batch.kept}
    swap = {id(g): g if id(g) in kept else dataclasses.replace(g, responses=[]) for g in _groups(message)}
    return _with_groups(message, swap)
