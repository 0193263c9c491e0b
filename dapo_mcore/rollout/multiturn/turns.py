"""The turns of a multi-turn rollout: each response's trajectory (the model's tokens and the tools', the loss mask, the
calls), and :class:`TurnStream`, the turn loop that hands out each group as soon as its responses have all ended and
can be aborted with the groups in flight kept, tool columns and all (partial rollouts).

An abort keeps every response exactly as far as it got: a turn still decoding keeps the tokens it had decoded (engines
whose ``resume_stream`` has ``unfinished()``; others lose that turn's tokens), a response whose call had not answered
keeps its ``</code>`` and nothing of the call (the call is given up; ``MultiTurnEngine.resume`` runs it again first:
tool outputs are deterministic functions of the code). Where a response stands at an abort therefore depends on the
decode step the abort came at, never on how fast a tool answered.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dapo_mcore.rollout.protocol import PartialGroup, Response, SamplingParams
from dapo_mcore.tools.registry import ToolOutput

__all__ = ["TURN_SEED_STRIDE", "TurnStream"]

TURN_SEED_STRIDE = 2_654_435_761
"""Turn t samples with seed ``params.seed + t * stride`` (mod 2**62): a stride far from the ones that tell steps,
generation calls and engine groups apart (10_007, 1, 1_000_003), so no two of them draw the same random stream."""


@dataclass
class _Trajectory:
    """One response as it grows: every token (the model's and the tools'), log-probs (NaN on tool tokens), the loss
    mask, the calls, and where it stands between turns."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    finish: str | None = None
    pending: Any = None          # the call this turn made: ToolPool.submit's (future, start) or a ToolOutput
    goes_on: bool = False         # a turn that ended in a </code> past max_calls (or a resumed response)
    segment: int = 0              # where the model's text since the last tool output begins (a call's code is there)
    start: int = 0                # tokens of the prefix a resume began with (not part of what it returns)
    calls0: int = 0               # the prefix's calls and errors (likewise)
    errors0: int = 0

    @classmethod
    def continuing(cls, prompt: list[int], prefix: Response | list[int]) -> _Trajectory:
        """A response to continue (``resume``): a Response keeps its tool columns; plain token ids are the model's."""
        if not isinstance(prefix, Response):
            prefix = Response(list(prefix), [], "length")
        ids = list(prefix.token_ids)
        mask = list(prefix.loss_mask) if prefix.loss_mask is not None else [True] * len(ids)
        lps = list(prefix.logprobs) if len(prefix.logprobs) == len(ids) else [math.nan] * len(ids)
        segment = max((j + 1 for j, m in enumerate(mask) if not m), default=0)
        return cls(list(prompt), ids, lps, mask, prefix.tool_calls, prefix.tool_errors, segment=segment,
                   start=len(ids), calls0=prefix.tool_calls, errors0=prefix.tool_errors)

    def add_model(self, resp: Response) -> None:
        self.tokens += resp.token_ids
        self.logprobs += resp.logprobs
        self.mask += [True] * resp.length

    def add_tool(self, ids: list[int], out: ToolOutput) -> None:
        self.tokens += ids
        self.logprobs += [math.nan] * len(ids)
        self.mask += [False] * len(ids)
        self.calls += 1
        self.errors += int(out.errored)
        self.segment = len(self.tokens)

    def response(self, with_logprobs: bool, finish: str | None = None) -> Response:
        """What the rollout returns from ``start`` on (a resume's new part; everything for ``generate``)."""
        finish = finish or self.finish
        assert finish in ("stop", "length")
        s = self.start
        return Response(token_ids=self.tokens[s:], logprobs=self.logprobs[s:] if with_logprobs else [],
                        finish_reason=finish, loss_mask=self.mask[s:], tool_calls=self.calls - self.calls0,
                        tool_errors=self.errors - self.errors0)


class TurnStream:
    """The groups of one multi-turn generation (or, with ``resumed``, continuation) call as they end; see the module
    docstring. ``mt`` is the MultiTurnEngine (its inner engine, codec, pool and limits); ``rows`` holds the
    ``params.n`` trajectories of each prompt in turn."""

    def __init__(self, mt: Any, rows: list[_Trajectory], params: SamplingParams, resumed: bool = False) -> None:
        self.mt, self.rows, self.params = mt, rows, params
        self.n = params.n
        self._left = [self.n] * (len(rows) // self.n)  # unfinished responses per group
        self._counted: set[int] = set()
        self._handed: set[int] = set()
        self._inner: Any = None
        self._live: list[int] = []
        self._partials: list[PartialGroup] = []
        self._steps = self._run(resumed)

    def __iter__(self) -> Iterator[tuple[int, list[Response]]]:
        with_lp = self.params.logprobs != "none"
        for ended in self._steps:
            for g in ended:
                self._handed.add(g)
                yield g, [r.response(with_lp) for r in self.rows[g * self.n:(g + 1) * self.n]]

    def _ended_groups(self, indices: list[int]) -> list[int]:
        """The groups that the rows ``indices`` finishing (those that have) completed."""
        out = []
        for i in indices:
            if self.rows[i].finish is not None and i not in self._counted:
                self._counted.add(i)
                self._left[i // self.n] -= 1
                if not self._left[i // self.n]:
                    out.append(i // self.n)
        return out

    def _run(self, resumed: bool) -> Iterator[list[int]]:
        """The turn loop; yields the groups that ended, after each response's turn and after each turn's calls."""
        mt, rows, p = self.mt, self.rows, self.params
        turn_params = dataclasses.replace(p, n=1, stop_sequences=tuple(p.stop_sequences) + (mt.codec.close_ids,))
        live = list(range(len(rows)))
        if resumed:  # a call that never answered runs first; the others just go on
            for i in live:
                if mt._unanswered(rows[i]):
                    rows[i].pending = mt._call(rows[i])
                else:
                    rows[i].goes_on = True
            live = mt._after_turn(rows, live, p.max_new_tokens)
            yield self._ended_groups(list(range(len(rows))))
        turn = 0
        while mt._more_turns(bool(live)):
            seed = None if p.seed is None else (p.seed + TURN_SEED_STRIDE * turn) % 2**62
            self._live = live
            self._inner = mt._continue([rows[i].prompt for i in live], [list(rows[i].tokens) for i in live],
                                       dataclasses.replace(turn_params, seed=seed))
            for k, resp in self._inner:
                row = rows[live[k]]
                row.add_model(resp)
                mt._ended(row, resp)
                yield self._ended_groups([live[k]])
            self._inner = None
            done, live = live, mt._after_turn(rows, live, p.max_new_tokens)
            yield self._ended_groups(done)
            turn += 1

    def abort(self, keep_partial: bool = False) -> int:
        """Stop: the tokens of the groups not handed out are dropped (returned: how many), or with ``keep_partial``
        kept for ``partials()`` as far as they got (0 returned)."""
        inflight: dict[int, tuple[Response, bool]] = {}
        if self._inner is not None:
            if hasattr(self._inner, "close"):
                self._inner.close()
            if hasattr(self._inner, "unfinished"):
                inflight = self._inner.unfinished()
        self._steps.close()
        self._inner = None
        max_new = self.params.max_new_tokens
        for k, (resp, ended) in sorted(inflight.items()):
            row = self.rows[self._live[k]]
            row.add_model(resp)
            if ended:
                self.mt._ended(row, resp, call=False)
        full = []  # a call with no room left for its output: answered now, as the whole rollout would have
        for i, row in enumerate(self.rows):
            if row.pending is not None and len(row.tokens) >= max_new:
                full.append(i)
            elif row.pending is not None:
                if not isinstance(row.pending, ToolOutput):
                    self.mt.pool.abandon(row.pending)
                row.pending = None
            row.goes_on = False
        self.mt._after_turn(self.rows, full, max_new)
        dropped = 0
        with_lp = self.params.logprobs != "none"
        for g in range(len(self._left)):
            if g in self._handed:
                continue
            group = self.rows[g * self.n:(g + 1) * self.n]
            if keep_partial:
                self._partials.append(PartialGroup(g, [r.response(with_lp, r.finish or "length") for r in group],
                                                   [r.finish is not None for r in group]))
            else:
                dropped += sum(len(r.tokens) - r.start for r in group)
        return dropped

    def partials(self) -> list[PartialGroup]:
        """The groups ``abort(keep_partial=True)`` kept, in prompt order."""
        return list(self._partials)
