"""The engine ranks of the async mode: generate batch k with version max(0, k - 1) while the trainer trains.

The engine ranks run the synchronous rollout side (``rollout.colocated.ColocatedRollouts``: engine groups, scoring
once over the engine ranks, overlong shaping, dynamic sampling, streaming, partial rollouts) over their own default
process group, and talk to the trainer in the order ``rollout.async_source`` fixes:

    receive version s (weights + start step + sampler/schedule state); evaluate it if flagged
    for k = start ...: generate batch k; receive version k (unless it is the start's); send batch k; evaluate
                       version k if flagged (while the trainer trains on batch k)
    receive the last version (evaluate it if flagged), then "stop"

Signals are the trainer's business (it checkpoints and tells the engines to stop): SIGTERM/SIGUSR1/SIGINT are
logged and otherwise ignored here, and the engines leave when the trainer says stop.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

from dapo_mcore.errors import UserError
from dapo_mcore.rollout.async_source import unflatten_bucket
from dapo_mcore.rollout.bridge import Bridge
from dapo_mcore.rollout.protocol import EngineError, WeightBucket
from dapo_mcore.signals import faults

log = logging.getLogger(__name__)

__all__ = ["EngineLoop"]


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
        self.version = -1
        self.prefix_version = 0
        self.wait_s = self.transfer_s = 0.0
        self.failed = False
        """This rank's rollout side failed; the trainer was told, reports it (one line) and ends the run with its
        code (2 for a user error such as a failing reward, 1 otherwise)."""

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._ignore) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        try:
            self._loop()
        except _Stop:
            pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.bridge.barrier()  # the trainer's shutdown barrier
        self.bridge.close()
        log.info("engine rank %d: stopped after version %d", self.bridge.role.rank, self.version)
        return 0  # a failure here was the trainer's to report: the job ends with its code (torchrun: the first non-zero)

    @staticmethod
    def _ignore(signum: int, frame: Any) -> None:
        log.info("engine rank: %s received; the trainer checkpoints and tells the engines to stop",
                 signal.Signals(signum).name)

    def _loop(self) -> None:
        header = self._receive()
        self._load_state(header.get("state"))
        if header["eval"]:
            self._evaluate()
        start_version = self.version
        steps = self.cfg.train.steps
        # A fresh start generates batch 0; a resume after s steps has batch s in the checkpoint, so s + 1, unless
        # the checkpoint is a finished run's last (no batch after it) whose train.steps was raised: then batch s.
        k = start_version + 1 if header.get("pending") else start_version
        self.prefix_version = max(0, start_version - 1)
        while k < steps:
            version = self.version  # the one generating batch k: k - 1, or the start's
            faults.point("generate", k)
            try:
                batch = self.rollouts.step_batch(k, stop=lambda: False)
            except Exception as exc:  # noqa: BLE001 - sent to the trainer, which reports it and stops the run
                if k > start_version:
                    # The trainer is publishing version k and reads nothing until the engines hold it: take it
                    # first, or both sides wait on each other.
                    self._receive()
                self._fail(exc)
                raise _Stop from exc
            seconds = self.timer.pop_step()
            header = self._receive() if k > start_version else {"eval": False}  # version k: after step k - 1
            self._send({"kind": "batch", "step": k, "batch": batch, "state": self.rollouts.scheduler.checkpoint_state(),
                        "version": version, "prefix_version": self.prefix_version,
                        "engine_ranks": self.bridge.role.engine_ranks,
                        "transfer_s": self.transfer_s,
                        "seconds": {"engine_generate_s": seconds.get("generate", 0.0),
                                    "engine_reward_s": seconds.get("reward", 0.0),
                                    "engine_wait_weights_s": self.wait_s, "weights_transfer_s": self.transfer_s}})
            if header["eval"]:  # version k, while the trainer trains on batch k (async_source: behind the trainer)
                self._evaluate()
            self.prefix_version = version
            k += 1
        while True:  # the last version (and its evaluation), then stop
            if self._receive()["eval"]:
                self._evaluate()

    # ---- weights ------------------------------------------------------------------------------------------------
    def _receive(self) -> dict[str, Any]:
        """The next version from the trainer, into the engine (bucket by bucket); its header says whether the
        caller evaluates it (where depends on the order above)."""
        t0 = time.monotonic()
        self.bridge.meet()  # the trainer is ready to publish (Bridge.meet)
        header = self.bridge.broadcast_header(None)
        if header.get("stop"):
            raise _Stop
        t1 = time.monotonic()
        self.engine.update_weights(self._buckets())
        self.version = int(header["version"])
        self.wait_s, self.transfer_s = t1 - t0, time.monotonic() - t1
        return header

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
        if self.bridge.sends_batches:
            self.bridge.send_object(message)

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
            self._receive()
