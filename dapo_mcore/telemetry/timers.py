"""Wall-clock seconds per named phase of a step (``with timer.phase("generate"): ...``).

Phases accumulate within a step (a phase entered twice adds up) and may nest when their names
differ (``step`` wraps the others). With CUDA present the device is synchronized on entering and
leaving a phase, so asynchronous kernels are charged to the phase that launched them; optional NVTX
ranges mark the phases in an Nsight Systems timeline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from dapo_mcore.telemetry import keys

logger = logging.getLogger(__name__)


class PhaseTimer:
    """Accumulate seconds per phase for the current step; ``pop_step()`` returns and resets them.

    Args:
        sync_cuda: synchronize CUDA around each phase boundary (ignored when CUDA is unavailable).
        nvtx: push an NVTX range named after the phase (only when CUDA is available).
    """

    def __init__(self, sync_cuda: bool = True, nvtx: bool = False) -> None:
        cuda = torch.cuda.is_available()
        self._sync = sync_cuda and cuda
        self._nvtx = nvtx and cuda
        self._seconds: dict[str, float] = {}
        self._active: list[str] = []
        self.on_phase: Any = None
        """Called with a phase's name as it opens (rank 0's ``telemetry.progress.StepProgress``), or None."""

    def _synchronize(self) -> None:
        if self._sync:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name``; re-entering a phase that is already open raises."""
        if name in self._active:
            raise ValueError(f"phase {name!r} is already open (open: {self._active}); phases of one name cannot nest")
        self._synchronize()
        if self._nvtx:
            torch.cuda.nvtx.range_push(name)
        self._active.append(name)
        if self.on_phase is not None:
            self.on_phase(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            elapsed = time.perf_counter() - start
            self._active.remove(name)
            if self._nvtx:
                torch.cuda.nvtx.range_pop()
            self._seconds[name] = self._seconds.get(name, 0.0) + elapsed

    def move(self, source: str, target: str, seconds: float) -> None:
        """Charge ``seconds`` already spent inside phase ``source`` (open, or closed this step) to ``target`` instead,
        e.g. the async trainer's wait for the engines inside its weight publish: every second counted once."""
        if seconds <= 0:
            return
        assert source in self._active or self._seconds.get(source, 0.0) >= seconds, (source, seconds, self._seconds)
        self._seconds[source] = self._seconds.get(source, 0.0) - seconds  # an open phase adds its elapsed at close
        self._seconds[target] = self._seconds.get(target, 0.0) + seconds

    def pop_step(self) -> dict[str, float]:
        """Seconds per phase accumulated since the last call, then reset. Raises if a phase is open."""
        if self._active:
            raise ValueError(f"pop_step() while phases {self._active} are still open; pop after the step ends")
        seconds, self._seconds = self._seconds, {}
        return seconds

    @staticmethod
    def as_metrics(seconds: dict[str, float]) -> dict[str, float]:
        """``{time/<phase>: seconds}`` for a ``pop_step()`` result."""
        return {keys.time_key(name): value for name, value in seconds.items()}
