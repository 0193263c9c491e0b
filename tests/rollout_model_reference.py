"""The rollout model's engine simulator and warm-up policy in their plain form (as they were before ``plan
--rank-variants`` was made fast): the reference ``tests/test_rollout_fast.py`` checks the fast ones against, event by
event and number by number. Not used by the product."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

import numpy as np

from dapo_mcore.plan.rollout_model import _EPS, EngineModel, batch_and_filter_step, streaming_step


class ReferenceEngineSim:
    """Event-driven continuous batching (see module docstring). Sequences are added per group with a target engine.

    Each engine keeps a token clock (the tokens every running sequence of it has decoded since the start): between
    two events on an engine its running count n is fixed, so its clock runs at 1 / (t0 + t1 n) tokens a second and a
    sequence admitted at clock c with r tokens left finishes at clock c + r. An event is the next such finish over
    all engines (a heap of the engines' next finish times), so one event costs O(log) work, not a pass over every
    slot of every engine."""

    def __init__(self, model: EngineModel) -> None:
        self.model = model
        e = model.engines
        self.queues: list[deque[int]] = [deque() for _ in range(e)]
        self.now = 0.0
        self.seq_len: list[int] = []
        self.seq_base: list[float] = []
        self.seq_group: list[int] = []
        self.seq_done: list[bool] = []
        self.group_left: list[int] = []
        self.group_seqs: list[list[int]] = []
        self.feeder = None
        """Optional callable(engine) -> bool that adds a group to that engine when its queue runs dry."""
        self._dirty = set(range(e))
        self._n = [0] * e  # running sequences per engine
        self._clock = [0.0] * e  # each engine's token clock at real time _synced[e]
        self._synced = [0.0] * e
        self._running: list[list[tuple[float, int, int]]] = [[] for _ in range(e)]  # heap: (finish clock, slot, seq)
        self._free = [list(range(model.max_seqs)) for _ in range(e)]  # heap of free slots (lowest first)
        self._events: list[tuple[float, int, int]] = []  # heap: (time, engine, version)
        self._version = [0] * e
        self._where: dict[int, tuple[int, float]] = {}  # running seq -> (engine, finish clock)
        self._total = 0

    def _iteration(self, e: int) -> float:
        return self.model.t0 + self.model.t1 * self._n[e]

    def _sync(self, e: int, t: float) -> None:
        self._clock[e] += (t - self._synced[e]) / self._iteration(e)
        self._synced[e] = t

    def _schedule(self, e: int) -> None:
        self._version[e] += 1
        if self._running[e]:
            t = self._synced[e] + (self._running[e][0][0] - self._clock[e]) * self._iteration(e)
            heapq.heappush(self._events, (t, e, self._version[e]))

    def add_group(self, engine: int, lengths: np.ndarray, progress: np.ndarray | None = None) -> int:
        """Queue one group's responses on ``engine``; ``progress`` tokens already generated each (partial rollouts)."""
        gid = len(self.group_left)
        prog = [0.0] * len(lengths) if progress is None else progress.tolist()
        seqs, left, queue = [], 0, self.queues[engine]
        for n, p in zip(lengths.tolist(), prog, strict=True):
            sid = len(self.seq_len)
            self.seq_len.append(int(n))
            self.seq_base.append(float(p))
            self.seq_group.append(gid)
            done = p >= n - _EPS
            self.seq_done.append(done)
            seqs.append(sid)
            if not done:
                queue.append(sid)
                left += 1
        assert left > 0, "a group with every response finished is complete; do not queue it"
        self.group_left.append(left)
        self.group_seqs.append(seqs)
        self._dirty.add(engine)
        return gid

    def wake(self) -> None:
        """Let every engine ask the feeder again at the next event (the admission budget grew)."""
        self._dirty = set(range(self.model.engines))

    def progress(self, gid: int) -> np.ndarray:
        """Tokens generated so far by each response of a group (their full length once finished)."""
        out = []
        for s in self.group_seqs[gid]:
            if self.seq_done[s]:
                out.append(float(self.seq_len[s]))
            elif s in self._where:
                e, finish = self._where[s]
                clock = self._clock[e] + (self.now - self._synced[e]) / self._iteration(e)
                out.append(self.seq_len[s] - (finish - clock))
            else:
                out.append(self.seq_base[s])
        return np.array(out)

    def _refill(self) -> None:
        cap = self.model.max_seqs
        for e in sorted(self._dirty):
            self._sync(e, self.now)
            q = self.queues[e]
            while self._n[e] < cap:
                if not q and not (self.feeder is not None and self.feeder(e)):
                    break
                s = q.popleft()
                finish = self._clock[e] + self.seq_len[s] - self.seq_base[s]
                heapq.heappush(self._running[e], (finish, heapq.heappop(self._free[e]), s))
                self._where[s] = (e, finish)
                self._n[e] += 1
                self._total += 1
            self._schedule(e)
        self._dirty = set()

    def advance(self, until_group: bool = False) -> list[int] | None:
        """As the product's: one event at a time, called again until a group completes with ``until_group``."""
        while True:
            done = self._advance_once()
            if done is None or done or not until_group:
                return done

    def _advance_once(self) -> list[int] | None:
        self._refill()
        if not self._total:
            return None
        events, version = self._events, self._version
        while events[0][2] != version[events[0][1]]:
            heapq.heappop(events)
        t = events[0][0]
        slack = _EPS * (self.model.t0 + self.model.t1 * self.model.max_seqs)  # _EPS tokens, in seconds at most
        engines = []
        while events and events[0][0] <= t + slack:
            _, e, v = heapq.heappop(events)
            if v == version[e]:
                engines.append(e)
        self.now = t
        finished = []
        for e in sorted(engines):
            self._sync(e, t)
            heap, before = self._running[e], len(finished)
            while heap and heap[0][0] - self._clock[e] <= _EPS:
                finished.append((e, *heapq.heappop(heap)[1:]))
            if len(finished) > before:
                self._dirty.add(e)  # refilled and rescheduled at the next advance
            else:
                self._schedule(e)  # within the slack but not yet done: its own time again
        completed = []
        for e, slot, s in sorted(finished):  # slot order within an engine, engines in order
            heapq.heappush(self._free[e], slot)
            del self._where[s]
            self._n[e] -= 1
            self._total -= 1
            self.seq_done[s] = True
            g = self.seq_group[s]
            self.group_left[g] -= 1
            if self.group_left[g] == 0:
                completed.append(g)
        return completed


def reference_generation(variant: str, pool: Any, recipe: Any, model: EngineModel, st: Any,
                         warm: dict | None = None) -> list:
    """``step_model.generation`` as it was: every step simulated, warm-up steps included (``warm`` is ignored)."""
    out, carry = [], []
    for _ in range(st.warmup + st.steps):
        if variant in ("today", "async"):
            res = batch_and_filter_step(pool, recipe, model)
        elif variant == "today_chunked":
            res = batch_and_filter_step(pool, recipe, model, chunk=st.chunk_prompts)
        elif variant.endswith("_done"):
            res, carry = streaming_step(pool, recipe, model, carry, partial="partial" in variant,
                                        max_staleness=st.max_staleness or 1, order="completion", chunk=0)
        else:
            chunk = (st.stream_chunk or recipe.gen_batch_prompts) if variant.endswith("_rr") else 0
            res, carry = streaming_step(pool, recipe, model, carry, partial="partial" in variant,
                                        max_staleness=st.max_staleness or 1, order=st.order, chunk=chunk)
        out.append(res)
    return out[st.warmup:]
