"""A bounded pool of worker processes that scores responses in parallel, with a per-answer timeout.

Why processes: a reward function is ordinary Python run on model text; a pathological input (or a bug in a
custom function) may hang or crash it. The pool isolates that: each worker scores a chunk of answers in order
and bumps a shared counter after each one, so the parent knows which answer a worker is on. An answer that runs
longer than ``timeout_s`` gets its worker killed and replaced, and is scored wrong with a reason; a worker that
dies is replaced the same way and blames the answer it was on. The rest of the chunk is re-queued. Results come
back in input order. Model text is only ever passed to the reward function as data: never ``eval``/``exec``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from dapo_mcore.reward.guard import FailureBreaker, RewardFailingError
from dapo_mcore.reward.registry import decode_tail, get_reward
from dapo_mcore.reward.result import RewardResult, as_result, failure

logger = logging.getLogger(__name__)

_Item = tuple[str | bytes, str]
_READY = "ready"
_STARTUP_TIMEOUT_S = 120.0


def _worker_main(conn: Connection, progress: Any, fn: Callable[..., RewardResult], fn_kwargs: dict) -> None:
    """Worker loop: receive ``list[(response, ground_truth)]``, score in order, send back the results."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown on Ctrl-C
    try:
        _serve(conn, progress, fn, fn_kwargs)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        # the parent's end of the pipe is gone. When the parent died with it (the rank that owns this pool was
        # killed or crashed: its own death is what gets reported) this worker has no one to answer and stops
        # quietly; a parent still alive that dropped the pipe is a bug, and raises
        parent = mp.parent_process()
        if parent is not None:
            parent.join(timeout=5.0)  # its pipe and its sentinel close together as it dies
            if parent.is_alive():
                raise


def _serve(conn: Connection, progress: Any, fn: Callable[..., RewardResult], fn_kwargs: dict) -> None:
    conn.send(_READY)
    while True:
        items = conn.recv()
        if items is None:
            return
        out = []
        for response, ground_truth in items:
            try:
                r = as_result(fn(response, ground_truth, **fn_kwargs))
                out.append((r.score, r.acc, r.pred, r.reason, r.failed))
            except Exception as exc:  # a failing answer is scored wrong, with the reason recorded (and counted)
                out.append((-1.0, False, None, f"reward function raised {type(exc).__name__}: {exc}"[:300], True))
            progress.value += 1
        conn.send(out)


@dataclass
class _Slot:
    """One worker process and the chunk it is scoring."""

    proc: Any
    conn: Connection
    progress: Any
    chunk: list[int] | None = None
    base: int = 0
    seen: int = 0
    since: float = 0.0


def _shutdown(slots: list[_Slot]) -> None:
    for slot in slots:
        if not slot.proc.is_alive():
            continue
        try:
            slot.conn.send(None)
        except (BrokenPipeError, OSError) as exc:  # died meanwhile: the join/kill below still reaps it
            logger.debug("reward worker %s gone before shutdown: %s", slot.proc.pid, exc)
    for slot in slots:
        slot.proc.join(timeout=2.0)
        if slot.proc.is_alive():
            slot.proc.kill()
            slot.proc.join(timeout=2.0)
        slot.conn.close()
    slots.clear()


class RewardPool:
    """Score ``(response, ground_truth)`` pairs in worker processes.

    Args:
        reward: a registered reward name (``"math_dapo"``) or a module-level callable
            ``fn(response, ground_truth, **fn_kwargs) -> RewardResult``.
        num_workers: worker processes (>= 1).
        timeout_s: most seconds one answer may take; beyond it the answer is scored wrong.
        chunk_size: answers sent to a worker at a time (amortizes inter-process overhead).
        mp_context: multiprocessing start method; "spawn" is safe next to threads and CUDA.
        fn_kwargs: extra keyword arguments for every call.
        tail_chars: for a callable, the response characters it reads (registered names bring their own);
            responses are sliced to that before leaving the parent process.
        breaker: counts failed answers (raised, timed out, crashed) as they come back and stops a ``score`` call
            with RewardFailingError when too many fail (``reward.guard``); None: failures are only scored wrong.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        reward: str | Callable[..., RewardResult] = "math_dapo",
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        chunk_size: int = 128,
        mp_context: str = "spawn",
        fn_kwargs: Mapping[str, Any] | None = None,
        tail_chars: int | None = None,
        breaker: FailureBreaker | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1")
        if isinstance(reward, str):
            spec = get_reward(reward)
            self._fn, self._tail = spec.fn, spec.tail_chars
        else:
            self._fn, self._tail = reward, tail_chars
        self._kwargs = dict(fn_kwargs or {})
        self._breaker = breaker
        self._timeout = timeout_s
        self._chunk_size = chunk_size
        self._ctx = mp.get_context(mp_context)
        self._slots: list[_Slot] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._slots)
        self.restarts = 0
        """Workers replaced so far (hangs and crashes)."""
        for _ in range(num_workers):
            self._slots.append(self._spawn())
        for slot in self._slots:
            self._await_ready(slot)

    @staticmethod
    def _await_ready(slot: _Slot) -> None:
        """Wait for a new worker's handshake: a worker that cannot start is an environment error, not an answer's."""
        try:
            if slot.conn.poll(_STARTUP_TIMEOUT_S) and slot.conn.recv() == _READY:
                return
        except (EOFError, OSError):
            slot.proc.join(timeout=2.0)
        raise RuntimeError(
            f"reward worker failed to start (exit code {slot.proc.exitcode}); with the 'spawn' start method the "
            "main module must be importable: guard scripts with `if __name__ == '__main__':`, and make the reward "
            "callable a module-level function"
        )

    def _spawn(self) -> _Slot:
        parent, child = self._ctx.Pipe(duplex=True)
        progress = self._ctx.RawValue("q", 0)
        proc = self._ctx.Process(target=_worker_main, args=(child, progress, self._fn, self._kwargs), daemon=True)
        proc.start()
        child.close()
        return _Slot(proc=proc, conn=parent, progress=progress)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def score(self, responses: Sequence[str | bytes], ground_truths: Sequence[str]) -> list[RewardResult]:
        """Results in input order; never raises for a bad answer (it is scored wrong with a reason)."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if not self._finalizer.alive:
            raise RuntimeError("RewardPool is closed")
        items: list[_Item] = [
            (decode_tail(r, self._tail) if self._tail is not None else r, g)
            for r, g in zip(responses, ground_truths, strict=True)
        ]
        results: list[RewardResult | None] = [None] * len(items)
        idx = list(range(len(items)))
        pending = deque(idx[i:i + self._chunk_size] for i in range(0, len(idx), self._chunk_size))
        try:
            self._score_all(items, results, pending)
        except RewardFailingError:
            for slot in self._slots:  # workers still on abandoned chunks are stopped (replaced at their next use)
                if slot.chunk is not None:
                    slot.proc.kill()
                    slot.proc.join(timeout=2.0)
                    slot.chunk = None
            raise
        return results  # type: ignore[return-value]  # every slot filled: the loop ends only then

    def _score_all(self, items: list[_Item], results: list, pending: deque) -> None:
        poll = min(0.05, self._timeout / 4)
        while pending or any(s.chunk is not None for s in self._slots):
            for slot in self._slots:
                if slot.chunk is None and pending:
                    self._dispatch(slot, pending.popleft(), items, results, pending)
            busy = {s.conn: s for s in self._slots if s.chunk is not None}
            for conn in wait(list(busy), timeout=poll):
                self._collect(busy[conn], results, pending)
            now = time.monotonic()
            for slot in self._slots:
                if slot.chunk is not None:
                    self._check_progress(slot, now, results, pending)

    def _dispatch(self, slot: _Slot, chunk: list[int], items: list[_Item], results: list, pending: deque) -> None:
        if not slot.proc.is_alive():  # died while idle (e.g. killed from outside): no answer to blame
            logger.warning("reward worker %s died while idle (exit code %s); replacing it",
                           slot.proc.pid, slot.proc.exitcode)
            self._respawn(slot)
        slot.chunk, slot.base = chunk, slot.progress.value
        slot.seen, slot.since = slot.base, time.monotonic()
        try:
            slot.conn.send([items[i] for i in chunk])
        except (BrokenPipeError, OSError):
            slot.proc.join(timeout=1.0)
            self._replace(slot, results, pending, f"reward worker crashed (exit code {slot.proc.exitcode})")

    def _collect(self, slot: _Slot, results: list, pending: deque) -> None:
        try:
            out = slot.conn.recv()
        except (EOFError, OSError):
            slot.proc.join(timeout=1.0)
            self._replace(slot, results, pending, f"reward worker crashed (exit code {slot.proc.exitcode})")
            return
        assert slot.chunk is not None and len(out) == len(slot.chunk)
        chunk, slot.chunk = slot.chunk, None
        for i, (score, acc, pred, reason, failed) in zip(chunk, out, strict=True):
            results[i] = RewardResult(score, acc, pred, reason, failed)
        for i in chunk:
            self._record(results[i])

    def _record(self, result: RewardResult) -> None:
        if self._breaker is not None:
            self._breaker.record(result)

    def _check_progress(self, slot: _Slot, now: float, results: list, pending: deque) -> None:
        value = slot.progress.value
        if value != slot.seen:
            slot.seen, slot.since = value, now
        elif now - slot.since > self._timeout:
            self._replace(slot, results, pending, f"reward timed out after {self._timeout:g}s")

    def _replace(self, slot: _Slot, results: list, pending: deque, reason: str) -> None:
        """Blame the answer the worker was on, re-queue the rest of its chunk, start a fresh worker."""
        assert slot.chunk is not None
        pos = slot.progress.value - slot.base
        chunk = slot.chunk
        rest = chunk[:pos] + chunk[pos + 1:]
        if rest:
            pending.appendleft(rest)
        self._respawn(slot)
        if pos < len(chunk):
            results[chunk[pos]] = failure(reason)
            logger.warning("%s on answer %d; replacing the worker", reason, chunk[pos])
            self._record(results[chunk[pos]])

    def _respawn(self, slot: _Slot) -> None:
        if slot.proc.is_alive():
            slot.proc.kill()
            slot.proc.join(timeout=2.0)
        slot.conn.close()
        fresh = self._spawn()
        self._await_ready(fresh)
        slot.proc, slot.conn, slot.progress, slot.chunk = fresh.proc, fresh.conn, fresh.progress, None
        self.restarts += 1
