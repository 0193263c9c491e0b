"""Partial rollouts: the groups a streamed step aborted, kept as far as they got and continued at the next step.

When streaming dynamic sampling (``rollout.schedule.streaming``) has kept enough groups it aborts the requests
still in flight. With ``rollout.schedule.partial`` those groups are not thrown away: :class:`PartialBuffer` keeps
each one's responses so far (token ids and the engine's log-probs, i.e. the behaviour policy's) with the step that
sampled them, and the next step continues every unfinished response with the new policy before it draws new
prompts (``ResumingEngine.resume``). A continued response is the old prefix followed by the new tokens
(:func:`join`); ``Response.stale_tokens`` says how many leading tokens the older policy sampled and
``Response.versions`` which version produced each token, and the trainer's truncated importance weights
(``algo.tis_cap``) correct them token by token against the recomputed old policy's log-probs.

Everything kept is continued at the very next step, so a prefix is one batch older than the batch that continues it
(one policy version in the synchronous loop; in async mode the engines' lead is one less than
``rollout.pipeline.max_staleness`` so that the prefix stays within it). A group whose oldest token would still lag
more than the bound (a resume with another bound) is dropped instead and counted (``RolloutScheduler``). The buffer
is part of the scheduler's checkpoint state, versions included: a resumed run continues the same partial groups.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from dapo_mcore.rollout.protocol import PartialGroup, Response

__all__ = ["PARTIALS_FILE", "Buffered", "PartialBuffer", "join", "runs", "split_partials", "stale_response", "join_partials"]


def runs(versions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(version, tokens)`` runs with empty runs left out and neighbours of one version merged."""
    out: list[tuple[int, int]] = []
    for v, n in versions:
        if n <= 0:
            continue
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + n)
        else:
            out.append((int(v), int(n)))
    return out


def join(prefix: Response, tail: Response, version: int) -> Response:
    """``prefix`` continued by ``tail`` (what ``resume`` sampled after it, by ``version``): one response whose first
    ``len(prefix)`` tokens are stale, each with the version that produced it. Tool columns (multi-turn tool use) are
    joined too: the loss mask end to end, the calls and errors summed."""
    assert prefix.versions is not None, "a buffered prefix always has its versions (PartialBuffer.add)"
    mask = None
    if prefix.loss_mask is not None or tail.loss_mask is not None:
        mask = [*_mask(prefix), *_mask(tail)]
    return Response(token_ids=list(prefix.token_ids) + list(tail.token_ids),
                    logprobs=list(prefix.logprobs) + list(tail.logprobs), finish_reason=tail.finish_reason,
                    stale_tokens=prefix.length, versions=runs([*prefix.versions, (version, tail.length)]),
                    loss_mask=mask, tool_calls=prefix.tool_calls + tail.tool_calls,
                    tool_errors=prefix.tool_errors + tail.tool_errors)


def _mask(r: Response) -> list[bool]:
    return [True] * r.length if r.loss_mask is None else list(r.loss_mask)


def stale_response(done: Response) -> Response:
    """A response that had already ended when its group was aborted: every token is stale."""
    return Response(token_ids=list(done.token_ids), logprobs=list(done.logprobs), finish_reason=done.finish_reason,
                    stale_tokens=done.length, versions=list(done.versions or []),
                    loss_mask=None if done.loss_mask is None else list(done.loss_mask), tool_calls=done.tool_calls,
                    tool_errors=done.tool_errors)


@dataclass
class Buffered:
    """One aborted group waiting to be continued."""

    index: int
    """The prompt's index in the sampler's records."""
    group: PartialGroup
    """Its responses as they stood when the stream was aborted."""
    step: int
    """The batch (the step it was generated for) that sampled them."""

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the buffered tokens (None: no token yet)."""
        return min((v for r in self.group.responses for v, _ in r.versions or []), default=None)


class PartialBuffer:
    """The aborted groups of the last streamed step (see module docstring)."""

    def __init__(self) -> None:
        self.items: list[Buffered] = []

    def add(self, indices: list[int], partials: list[PartialGroup], step: int, version: int | None = None) -> None:
        """Keep ``partials`` of a stream call whose prompt ``i`` is sampler record ``indices[i]``, sampled by policy
        ``version`` (the synchronous loop's: ``step``) for batch ``step``."""
        version = step if version is None else version
        for p in partials:
            if not p.done or len(p.done) != len(p.responses):
                raise ValueError(f"partial group {p.index}: {len(p.responses)} responses, {len(p.done)} done flags")
            for r in p.responses:
                if r.versions is None:
                    r.versions = runs([(version, r.length)])
            self.items.append(Buffered(indices[p.index], p, step))

    def take(self) -> list[Buffered]:
        """Every buffered group, oldest first; the buffer is empty afterwards."""
        items, self.items = self.items, []
        return items

    def num_tokens(self) -> int:
        """Tokens generated for the buffered groups (not yet in any ledger count)."""
        return sum(b.group.num_tokens() for b in self.items)

    def state_dict(self) -> list[dict[str, Any]]:
        """What a checkpoint stores (JSON-able, a copy). Token ids and log-probs are packed (little-endian int32 and
        float64, base64): a 32B step may buffer hundreds of groups of 20k-token responses, which as JSON lists would
        be one line per number in trainer_state.json. float64 keeps every log-prob bit for bit (a tool token's NaN
        too). Multi-turn tool use adds each response's loss mask (packed bytes) and tool counts."""
        return [{"index": b.index, "step": b.step, "position": b.group.index, "done": list(b.group.done),
                 "responses": [{"token_ids": _pack(r.token_ids, "<i4"), "logprobs": _pack(r.logprobs, "<f8"),
                                "finish_reason": r.finish_reason, "versions": [list(x) for x in r.versions or []],
                                **_tool_state(r)}
                               for r in b.group.responses]}
                for b in self.items]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        """A checkpoint's buffer; one written before versions were recorded gets its batch's step as their version
        (the synchronous loop's)."""
        def response(r: dict[str, Any], step: int) -> Response:
            ids = [int(t) for t in _unpack(r["token_ids"], "<i4")]
            versions = r.get("versions")
            mask = r.get("loss_mask")  # absent: no tool columns (a run without tools, or an older checkpoint)
            return Response(ids, [float(x) for x in _unpack(r["logprobs"], "<f8")], r["finish_reason"],
                            versions=runs([(step, len(ids))] if versions is None else [tuple(x) for x in versions]),
                            loss_mask=None if mask is None else [bool(x) for x in _unpack(mask, "<u1")],
                            tool_calls=int(r.get("tool_calls", 0)), tool_errors=int(r.get("tool_errors", 0)))

        self.items = [Buffered(int(d["index"]), PartialGroup(
            int(d["position"]), [response(r, int(d["step"])) for r in d["responses"]], [bool(x) for x in d["done"]]),
            int(d["step"])) for d in state]


PARTIALS_FILE = "partials.pt"
"""In a checkpoint: the partial buffer's tokens and log-probs, binary (``torch.save`` of tensors), beside
``trainer_state.json``, whose ``schedule.partials`` then says ``{"file": "partials.pt"}``. Checkpoints written before
hold them base64-packed in ``trainer_state.json`` itself; those still load."""


def split_partials(state: dict[str, Any]) -> bytes | None:
    """Move a trainer state's buffered partial groups (``schedule.partials``, the ``state_dict`` form) out into the
    bytes of ``PARTIALS_FILE``; the state keeps a reference to the file. None (state untouched) when nothing is
    buffered."""
    import io

    import torch

    schedule = state.get("schedule")
    items = schedule.get("partials") if isinstance(schedule, dict) else None
    if not items or not isinstance(items, list):
        return None
    binary = [{**d, "responses": [{**r, "token_ids": torch.from_numpy(_unpack(r["token_ids"], "<i4").copy()),
                                    "logprobs": torch.from_numpy(_unpack(r["logprobs"], "<f8").copy())}
                                   for r in d["responses"]]} for d in items]
    buf = io.BytesIO()
    torch.save(binary, buf)
    schedule["partials"] = {"file": PARTIALS_FILE, "groups": len(items)}
    return buf.getvalue()


def join_partials(state: dict[str, Any], ckpt_dir: Any) -> None:
    """The inverse, at a resume: a ``schedule.partials`` that names a file is read back from ``ckpt_dir`` (in place,
    into the ``state_dict`` form ``PartialBuffer.load_state_dict`` takes); the older inline form is left as it is.
    A missing file is a one-line error naming it."""
    from pathlib import Path

    import torch

    from dapo_mcore.errors import UserError

    schedule = state.get("schedule")
    ref = schedule.get("partials") if isinstance(schedule, dict) else None
    if not isinstance(ref, dict):
        return
    path = Path(ckpt_dir) / ref["file"]
    if not path.is_file():
        raise UserError(f"checkpoint {ckpt_dir} names its partial rollouts in {ref['file']}, which is missing; restore "
                        f"the file or resume from another checkpoint.")
    try:
        binary = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file: one line naming it
        raise UserError(f"checkpoint {ckpt_dir}: {ref['file']} cannot be read ({type(exc).__name__}); restore the "
                        f"file or resume from another checkpoint.") from exc
    schedule["partials"] = [{**d, "responses": [{**r, "token_ids": _pack(r["token_ids"].tolist(), "<i4"),
                                                 "logprobs": _pack(r["logprobs"].tolist(), "<f8")}
                                                for r in d["responses"]]} for d in binary]


def _tool_state(r: Response) -> dict[str, Any]:
    """A buffered response's tool columns as the checkpoint stores them (nothing for a response without)."""
    if r.loss_mask is None:
        return {}
    return {"loss_mask": _pack(r.loss_mask, "<u1"), "tool_calls": r.tool_calls, "tool_errors": r.tool_errors}


def _pack(values: list, dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")


def _unpack(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype)
