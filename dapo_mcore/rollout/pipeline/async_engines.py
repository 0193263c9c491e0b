"""The engine ranks of the async mode: generate batch k with version max(start, k - D) while the trainer trains.

D, the engines' lead (``async_source.lead``), is ``rollout.pipeline.max_staleness`` (one less with partial rollouts,
whose continued prefixes are one version older than the batch). The engine ranks run the synchronous rollout side
(``rollout.pipeline.colocated.ColocatedRollouts``: engine groups, scoring once over the engine ranks, overlong
shaping, dynamic sampling, streaming, partial rollouts) over their own default process group, and talk to the trainer
in the order ``rollout.pipeline.async_source`` fixes:

    receive version s (weights + start step + sampler/schedule state + batches pending); evaluate it if flagged
    for k = s + pending ...: take every version up to k - D (waiting only for one the trainer has not published
                       yet; evaluate each flagged one), generate batch k, queue batch k for the trainer
    take the remaining versions (evaluating the flagged ones), then "stop"

A version lands in the engine between two batches (the start of batch v + D), never mid-batch: the point is a pure
function of the step, so a run is a pure function of its seed and resumes exactly (an update at whichever decode
step it arrived would depend on the wall clock). With partial rollouts, the sequences in flight across that point
(aborted at the end of batch k - 1) continue under the new version, and their tokens keep the version that produced
each (``Response.versions``). Batches are sent on their own thread and, with D > 1, versions received on another
(``rollout.pipeline.async_channels``), so the engines wait for the trainer only when they need a version it has not
published.

Signals are the trainer's business (it checkpoints and tells the engines to stop): every signal the trainer answers
(SIGTERM/SIGUSR1/SIGHUP/SIGINT, ``IGNORED_SIGNALS``) is logged and otherwise ignored here, and the engines leave
when the trainer says stop (a SIGHUP that killed the engine ranks ended the job with 129 and no checkpoint).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

from dapo_mcore.errors import UserError
from dapo_mcore.rollout.pipeline.async_channels import BatchSender, Received, VersionReceiver
from dapo_mcore.rollout.pipeline.async_source import lead, unflatten_bucket
from dapo_mcore.rollout.pipeline.bridge import Bridge
from dapo_mcore.rollout.pipeline.host_shard import ReadRecorder, expand, stage, staged_bytes
from dapo_mcore.rollout.protocol import EngineError, WeightBucket
from dapo_mcore.signals import faults, startup

log = logging.getLogger(__name__)

IGNORED_SIGNALS = tuple(sorted(startup.WATCHED))
"""The stop signals the trainer answers (it checkpoints and tells the engines to stop); the engine ranks ignore them
all: one of them killing an engine rank would end the job without the trainer's checkpoint."""

__all__ = ["EngineLoop"]

SENDER_DRAIN_S = 1.0
"""At the stop: how long the sender may take to finish. The trainer says stop only once it has read everything it
will read (the batches it trains and checkpoints, the evaluations it waits for), so what is left (a batch generated
past a checkpoint the trainer stopped at) is never read: the loop does not wait for it."""


class _Stop(Exception):
    """The trainer said stop."""


class EngineLoop:
    """Drives one engine rank (module docstring).

    Args:
        cfg: the run's config.
        rollouts: the engine side's ColocatedRollouts (over the engine ranks' process group).
        engine: the rollout engine (weights land here).
        bridge: the groups to the trainer.
        eval_records: the held-out prompts.
        timer: the engine side's PhaseTimer (``generate``/``reward`` seconds of each batch).
    """

    def __init__(self, cfg: Any, rollouts: Any, engine: Any, bridge: Bridge, eval_records: list, timer: Any):
        self.cfg, self.rollouts, self.engine, self.bridge = cfg, rollouts, engine, bridge
        self.eval_records, self.timer = eval_records, timer
        self.lead = lead(cfg)
        """D: batch k is sampled by version max(start, k - D)."""
        self.version = -1
        self.wait_s = self.transfer_s = 0.0
        self.failed = False
        """This rank's rollout side failed; the trainer was told, reports it (one line) and ends the run with its
        code (2 for a user error such as a failing reward, 1 otherwise)."""
        self._sender = BatchSender(bridge.send_packed, bridge.pack) if bridge.sends_batches else None
        self._versions: VersionReceiver | None = None
        self._recorder = ReadRecorder() if self.lead > 1 else None
        """With staged versions: records, while the start's version loads, what part of each tensor the engine
        reads; only that is staged afterwards (``rollout.pipeline.host_shard``)."""
        self._regions: dict[str, Any] | None = None
        self.staged_bytes = 0
        """Host bytes of the largest version staged so far (about 1/k of the model at vLLM tensor parallel k)."""

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._ignore) for sig in IGNORED_SIGNALS}
        try:
            self._loop()
        except _Stop:
            pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._sender is not None and not self._sender.close(SENDER_DRAIN_S):
            log.info("engine rank 0: batches generated past the trainer's last checkpoint are dropped (generated "
                     "again, the same, when the run resumes)")
        self.bridge.barrier()  # the trainer's shutdown barrier
        self.bridge.close()
        log.info("engine rank %d: stopped after version %d", self.bridge.role.rank, self.version)
        return 0  # a failure here was the trainer's to report: the job ends with its code (torchrun: the first non-zero)

    @staticmethod
    def _ignore(signum: int, frame: Any) -> None:
        log.info("engine rank: %s received; the trainer checkpoints and tells the engines to stop",
                 signal.Signals(signum).name)

    def _loop(self) -> None:
        header = self._apply(self._receive(), 0.0)  # the start's version, straight into the engine
        self._load_state(header.get("state"))
        if header["eval"]:
            self._evaluate()
        steps = self.cfg.train.steps
        # A fresh start generates batch 0; a resume after s steps has batches s .. s + n - 1 in the checkpoint, so
        # s + n (n = 0 for a finished run's last checkpoint whose train.steps was raised: then batch s).
        k = first = self.version + int(header.get("pending") or 0)
        if self.lead > 1:
            self._start_receiver()
        while k < steps:
            while self.version < k - self.lead:  # version k - D: published after step k - D - 1
                self._take()
            if self._sender is not None and k - self.lead >= first:  # the trainer reads it once it published k - D
                self._sender.wait_delivered(k - self.lead)
            faults.point("generate", k)
            self.rollouts.version = self.version
            try:
                batch = self.rollouts.step_batch(k, stop=lambda: False)
            except Exception as exc:  # noqa: BLE001 - sent to the trainer, which reports it and stops the run
                self._fail(exc)
                raise _Stop from exc
            seconds = self.timer.pop_step()
            self._send({"kind": "batch", "step": k, "batch": batch, "state": self.rollouts.scheduler.checkpoint_state(),
                        "version": self.version, "engine_ranks": self.bridge.role.engine_ranks,
                        "transfer_s": self.transfer_s,
                        "seconds": {"engine_generate_s": seconds.get("generate", 0.0),
                                    "engine_reward_s": seconds.get("reward", 0.0),
                                    "engine_wait_weights_s": self.wait_s, "weights_transfer_s": self.transfer_s}})
            self.wait_s = self.transfer_s = 0.0
            k += 1
        while True:  # the versions after the last batch (and their evaluations), then stop
            self._take()

    # ---- weights ------------------------------------------------------------------------------------------------
    def _start_receiver(self) -> None:
        """Versions arrive while the engines generate, at most D - 1 of them on the host, each only the part this
        rank's engine reads (recorded while the start's version loaded)."""
        import torch

        if self._recorder is not None:
            self._regions, self._recorder = self._recorder.regions(), None
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._versions = VersionReceiver(lambda: self._receive(staged=True), self.lead - 1, _Stop, device)

    def _take(self) -> None:
        """The next version into the engine, at a batch boundary; evaluated if its header says so."""
        if self._versions is None:
            t0 = time.monotonic()
            received = self._receive()
            waited = time.monotonic() - t0 - received[2]
        else:
            received, waited = self._versions.take()
        header = self._apply(received, waited)
        if self._versions is not None:
            del received  # the host copy goes before the next receive may start
            self._versions.release()
        if header["eval"]:
            self._evaluate()

    def _apply(self, received: Received, waited: float) -> dict[str, Any]:
        header, buckets, transfer = received
        t0 = time.monotonic()
        if buckets is not None:  # staged on the host by the receiver thread, each bucket at full shape again
            self.engine.update_weights(expand(bucket) for bucket in buckets)
        self.version = int(header["version"])
        self.wait_s += waited
        self.transfer_s += transfer + time.monotonic() - t0
        return header

    def _receive(self, staged: bool = False) -> Received:
        """The next version from the trainer: straight into the engine (bucket by bucket) on the loop's thread, kept
        on the host on the receiver's (then ``buckets`` is the list, applied when the loop takes it)."""
        self.bridge.meet()  # the trainer is ready to publish (Bridge.meet)
        header = self.bridge.broadcast_header(None)
        if header.get("stop"):
            raise _Stop
        t1 = time.monotonic()
        if staged:
            buckets = [stage(bucket, self._regions or {}) for bucket in self._buckets()]
            kept, whole = staged_bytes(buckets)
            if not self.staged_bytes:
                log.info("engine rank %d: stages %.1f MiB of each %.1f MiB version (its engine's shard), at most %d "
                         "version(s) at once", self.bridge.role.rank, kept / 2**20, whole / 2**20, self.lead - 1)
            self.staged_bytes = max(self.staged_bytes, kept)
        else:
            received = self._buckets()
            self.engine.update_weights(received if self._recorder is None else self._recorder.wrap(received))
            buckets = None
        return header, buckets, time.monotonic() - t1

    def _buckets(self) -> Iterator[WeightBucket]:
        while True:
            head = self.bridge.broadcast_header(None)
            if head.get("end"):
                return
            if head.get("stop"):  # the trainer failed half way through a version and is shutting down
                raise _Stop
            flat = self.bridge.empty_flat(int(head["bytes"]))
            yield unflatten_bucket(head["bucket"], self.bridge.broadcast_flat(flat))

    def _evaluate(self) -> None:
        if self.failed:  # waiting for the trainer's stop: nobody reads an evaluation
            return
        t0 = time.monotonic()
        try:
            groups = self.rollouts.eval_groups(self.eval_records, self.version)
        except Exception as exc:  # noqa: BLE001 - sent to the trainer, which reports it and stops the run
            self._fail(exc)
        self._send({"kind": "eval", "version": self.version, "groups": groups, "seconds": time.monotonic() - t0})

    # ---- state and messages -------------------------------------------------------------------------------------
    def _load_state(self, state: dict[str, Any] | None) -> None:
        """A resume's sampler/schedule state (none at a fresh start)."""
        if state and state.get("sampler") is not None:
            self.rollouts.scheduler.load_checkpoint_state(state)

    def _send(self, message: dict[str, Any]) -> None:
        if self._sender is not None:
            self._sender.put(message)

    def _fail(self, exc: Exception) -> None:
        """Any failure of the rollout side (generation, a reward, an evaluation, memory): the trainer gets it and
        reports it in one line; this rank waits for the stop and ends with the run's code, without a traceback."""
        from dapo_mcore.algo.dynamic_sampling import DynamicSamplingExhausted

        self.failed = True
        if isinstance(exc, DynamicSamplingExhausted):
            self._send({"kind": "error", "error": "exhausted", "message": str(exc), "stats": exc.stats})
        elif isinstance(exc, UserError):  # a failing reward, ...: the trainer raises it as such (one line, exit 2)
            self._send({"kind": "error", "error": "user", "message": str(exc)})
        else:
            text = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
            self._send({"kind": "error", "error": "engine", "message": text})
        log.info("engine rank %d: %s: %s (the trainer reports it and stops the run)", self.bridge.role.rank,
                 type(exc).__name__, exc)
        while True:  # the trainer reports it and says stop
            self._take()
