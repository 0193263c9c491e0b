"""The tool pool: tool calls run in a bounded thread pool while the engine keeps decoding the other responses.

Every fault of a call (the tool raised, hung past its deadline, flooded its output, its sandbox failed to start)
becomes error text in the trajectory and a counter, never an exception out of the rollout or a hang of it. A call
that overruns its deadline is given up (the python tool's sandbox kills its process tree at ``timeout_s`` itself; the
deadline is the backstop for a tool of your own that ignores it). A call's deadline counts from when a worker takes it
up, not from when it was queued: a burst of calls waits its turn without timing out; the queue wait itself is bounded
by the calls ahead of it (each takes at most ``deadline_s``), so a pool whose workers all hang still never hangs the
rollout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields

from dapo_mcore.signals import faults
from dapo_mcore.tools.registry import ToolOutput

__all__ = ["ToolCounters", "ToolPool"]

logger = logging.getLogger(__name__)

DEADLINE_GRACE_S = 5.0
"""How much longer than the tool's own timeout a call may take before the pool gives it up."""


@dataclass
class ToolCounters:
    """Additive counters of the tool calls answered since the last :meth:`ToolPool.take_counters`."""

    calls: int = 0
    errors: int = 0
    """Calls whose output is not a clean result (every kind but ``ok``: an error, a timeout, cut output, no sandbox)."""
    timeouts: int = 0
    sandbox_failures: int = 0
    seconds: float = 0.0
    """Wall seconds of the calls, summed (calls overlap each other and decoding: it may exceed the rollout's wall)."""
    waited: float = 0.0
    """Wall seconds the rollout stood waiting for calls after its decoding had run out of work: the tool time that
    decoding did not hide."""

    def add(self, out: ToolOutput) -> None:
        self.calls += 1
        self.errors += int(out.errored)
        self.timeouts += int(out.kind == "timeout")
        self.sandbox_failures += int(out.kind == "sandbox_failure")
        self.seconds += out.seconds

    def metrics(self, prefix: str = "tools/") -> dict[str, float]:
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


class ToolPool:
    """Runs a tool (``text -> ToolOutput``, e.g. a registry :class:`~dapo_mcore.tools.registry.Tool`) on up to
    ``workers`` threads; :meth:`output` waits for a call at most ``deadline_s`` from its start."""

    def __init__(self, tool: Callable[[str], ToolOutput], workers: int, deadline_s: float) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        self.tool, self.deadline_s = tool, deadline_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")
        self.workers = workers
        self._lock = threading.Lock()
        self._counters = ToolCounters()
        self._outstanding = 0  # submitted, not yet answered (or given up)
        self._taken_up = 0  # calls a worker has started, since the process began (the resume tests' fault point)

    def _run(self, text: str, started: list[float]) -> ToolOutput:
        start = time.monotonic()
        started.append(start)
        with self._lock:
            self._taken_up += 1
            index = self._taken_up
        faults.point("tool", index)  # the kill -9 resume test: this process dies inside its index-th tool call
        try:
            out = self.tool(text)
        except Exception as exc:  # a registry Tool never raises; any other callable's fault is still only data
            logger.warning("tool call raised %s: %s", type(exc).__name__, exc)
            out = ToolOutput(f"{type(exc).__name__}: {exc}".splitlines()[0], "error")
        if not isinstance(out, ToolOutput):
            out = ToolOutput(f"the tool returned {type(out).__name__}, not a ToolOutput", "error")
        return ToolOutput(out.text, out.kind, time.monotonic() - start)

    def submit(self, text: str) -> tuple[Future, list[float], float]:
        """Queue a call; the handle :meth:`output` takes."""
        with self._lock:
            ahead = self._outstanding
            self._outstanding += 1
        started: list[float] = []  # the worker writes the time it took the call up
        queue_bound = self.deadline_s * (ahead // self.workers + 1)
        return self._pool.submit(self._run, text, started), started, time.monotonic() + queue_bound

    def output(self, call: tuple[Future, list[float], float]) -> ToolOutput:
        """A call's output, counted; past its deadline a timeout output (the call is given up)."""
        future, started, start_by = call
        waiting = time.monotonic()
        try:
            while not started and not future.done():  # queued: wait for a worker, at most until start_by
                if time.monotonic() > start_by:
                    raise FutureTimeout
                time.sleep(0.005)
            left = self.deadline_s - (time.monotonic() - started[0]) if started else 0.0
            out = future.result(timeout=max(left, 0.0))
        except FutureTimeout:
            future.cancel()
            logger.warning("a tool call overran its %.1f s deadline; given up", self.deadline_s)
            out = ToolOutput(f"TimeoutError: the tool did not answer within {self.deadline_s:g} s", "timeout",
                             self.deadline_s)
        with self._lock:
            self._outstanding -= 1
            self._counters.waited += time.monotonic() - waiting
        return self.record(out)

    def abandon(self, call: tuple[Future, list[float], float]) -> None:
        """Give up a call whose output is no longer wanted (its rollout was aborted; a resumed rollout runs it again):
        cancelled if still queued, else left to finish (within the tool's own timeout) unread; not counted."""
        call[0].cancel()
        with self._lock:
            self._outstanding -= 1

    def record(self, out: ToolOutput) -> ToolOutput:
        """Count a call's output (also one that never reached the tool: a ``</code>`` without ``<code>``)."""
        with self._lock:
            self._counters.add(out)
        return out

    def take_counters(self) -> ToolCounters:
        """The counters since the last call, reset."""
        with self._lock:
            out, self._counters = self._counters, ToolCounters()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
