"""The engine ranks' two channels to the trainer in async mode, each on a thread of its own so generation never
waits on the trainer for anything but a version it needs (``rollout.pipeline.async_engines``):

- ``BatchSender`` (engine rank 0): the batches, evaluations and failures, sent in the order they were queued. A
  gloo send returns only once the trainer posts the matching receive, and the trainer receives a batch only when it
  trains on it: the engines running ahead queue their batches here and go on generating.
- ``VersionReceiver`` (every engine rank, ``rollout.pipeline.max_staleness`` > 1): the trainer's versions, received
  as soon as the trainer publishes them, at most ``staged`` (D - 1) on the host at once counting the one being
  received and the one being loaded, kept there until the engines take them at a batch boundary; on a GPU on the
  engine's device and a side stream of its own. With ``staged = 0`` (one-step-off) nothing runs ahead: the engine
  loop receives each version itself, straight into the engine, when it needs it.

A version lands in the engine only at a batch boundary (the start of the batch it samples), never mid-batch: where it
lands is then a pure function of the step, so a run stays a pure function of its seed and resumes exactly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["BatchSender", "Received", "VersionReceiver"]

Received = tuple[dict[str, Any], list[Any] | None, float]
"""A version as received: its header, its buckets (None when it went straight into the engine; staged, the part of
each tensor this rank's engine reads, ``rollout.pipeline.host_shard``), the seconds its transfer took."""


class BatchSender:
    """Sends queued messages to the trainer in order, on a daemon thread (module docstring)."""

    def __init__(self, send: Callable[[Any], None], pack: Callable[[dict[str, Any]], Any]) -> None:
        self._send, self._pack = send, pack
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._delivered = -1
        """The step of the last batch the trainer has received."""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dapo-engine-sender", daemon=True)
        self._thread.start()

    def put(self, message: dict[str, Any]) -> None:
        """Packed now (the message may hold state that changes after this call), sent when the trainer reads."""
        self._raise()
        step = message["step"] if message["kind"] == "batch" else None
        self._queue.put((step, self._pack(message)))

    def wait_delivered(self, step: int) -> None:
        """Until the trainer has received batch ``step`` (it reads it right after publishing the version the engines
        just took, so this is short): the trainer then holds every batch the engines lead it by, whatever happens to
        the engines next (a checkpoint after that step has them)."""
        with self._cond:
            self._cond.wait_for(lambda: self._delivered >= step or self._error is not None)
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sending to the trainer failed: {self._error}") from self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, packed = item
            try:
                self._send(packed)
            except Exception as exc:  # noqa: BLE001 - the trainer is gone or failed; the loop learns at its next put
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            if step is not None:
                with self._cond:
                    self._delivered = step
                    self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) for the queue to drain; False when messages nobody reads are left (a
        run stopped after a checkpoint, or failed): the daemon thread is left behind and ends with the process."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


class VersionReceiver:
    """Receives the trainer's versions on a thread, at most ``staged`` held on the host at any time.

    A version counts from the moment its receive starts until the loop has loaded it into the engine and
    ``release``d it: the one being received, those waiting and the one being loaded together never exceed
    ``staged`` (D - 1, what docs/rollout.md states), so an engine rank holds at most that many copies of its engine's
    shard (``rollout.pipeline.host_shard``).

    On a GPU the thread sets the engine's device (a new thread starts on device 0) and runs its receives on a side
    stream of its own, so the weights group's broadcasts never queue on the stream vLLM generates on; each version
    carries an event recorded after its last copy, which the loop waits on (``take``) before loading it.

    Args:
        receive: receives the next version (meet, header, buckets) and returns ``Received``; raises ``stop`` when the
            trainer said stop.
        staged: how many versions may be on the host at once (>= 1).
        stop: the exception ``receive`` raises on the trainer's stop (re-raised by ``take``).
        device: the engine's CUDA device index (None: no CUDA, nothing to set).
    """

    def __init__(self, receive: Callable[[], Received], staged: int, stop: type[BaseException],
                 device: int | None = None) -> None:
        assert staged >= 1, staged
        self._receive, self._staged, self._stop, self._device = receive, staged, stop, device
        self._queue: queue.Queue = queue.Queue()
        self._started = 0
        """Receives begun (each a version on the host from then on)."""
        self._released = 0
        """Versions the loop has loaded and let go."""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dapo-engine-versions", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream = _side_stream(self._device)
        while True:
            with self._cond:  # the receive about to start counts: at most ``staged`` versions on the host
                self._cond.wait_for(lambda: self._started < self._released + self._staged)
                self._started += 1
            try:
                got = self._receive_on(stream)
            except BaseException as exc:  # noqa: BLE001 - the stop or a failure: handed to the loop by ``take``
                self._queue.put(exc)
                return
            self._queue.put(got)
            del got  # held here it would outlive the loop's release: one more copy on the host

    def _receive_on(self, stream: Any) -> tuple[Received, Any]:
        if stream is None:
            return self._receive(), None
        import torch

        with torch.cuda.stream(stream):
            got = self._receive()
            done = torch.cuda.Event()
            done.record(stream)
        return got, done

    def take(self) -> tuple[Received, float]:
        """The next version (its copies complete) and the seconds the loop waited for it (0 when it had arrived).
        Call ``release`` once it is loaded into the engine and no longer referenced."""
        t0 = time.monotonic()
        got = self._queue.get()
        if isinstance(got, BaseException):
            self._queue.put(got)  # every later take says the same
            raise got
        received, done = got
        if done is not None:
            done.synchronize()
        return received, time.monotonic() - t0

    def release(self) -> None:
        """The version last taken is loaded: its host copy may go, and the next receive may start."""
        with self._cond:
            self._released += 1
            self._cond.notify_all()


def _side_stream(device: int | None) -> Any:
    """In the receiver thread: set the engine's CUDA device and make the stream its receives run on (None without
    CUDA)."""
    if device is None:
        return None
    import torch

    torch.cuda.set_device(device)
    return torch.cuda.Stream(device=device)
