"""The async mode's RolloutSource on the trainer ranks: batches arrive from engine ranks that generate ahead.

The protocol (one order, fixed, so a run is a pure function of its seed; ``rollout.async_engines`` is the other side):

    trainer rank 0 --weights--> engines   version s (the start: weights, the step to generate from, the sampler and
                                          schedule state), then one version after every training step, then "stop"
    engine rank 0  --batches--> trainer   batch k, sampled by version max(0, k - 1); an evaluation of version v when
                                          the trainer flags it (eval.at_start, eval.every, the last step), sent after
                                          the batch that version's publish waited for

The engines send batch k only after they hold version k, so the trainer's publish of version k returns when batch k
is ready: while the trainer trains step k on batch k, the engines generate batch k + 1 with version k. Every trained
token is one version old (two for the prefixes partial rollouts continue), counted in ``async/lag_*``.

Evaluation runs behind the trainer: the engines evaluate version v (an eval step; not the first, the last, the one
before it, nor any with ``eval.every: 1``: ``evaluates_behind``) while the trainer trains the next step, and the trainer takes the result at its next publish, before the meeting
(the engines send it before they generate on): it lands in step v + 1's metrics, with ``eval/policy_version: v``.
Version 0 (``eval.at_start``) and the last version are waited for, as nothing trains beside them. A checkpoint after
an eval step v is taken before v's evaluation arrives; a run resumed from it has the engines evaluate its start
version v again (the same weights and seeds), so the result lands where it would have. ``DAPO_MCORE_EVAL_INLINE=1``
makes the trainer wait for every evaluation after its step (the baseline of ``benchmarks/async_pipeline.py``).

A checkpoint after step k holds batch k + 1 (already generated, by version k) and the sampler/schedule state after
it: a resumed run trains on exactly that batch and the engines go on from exactly that state, so kill -9, SIGTERM and
requeue resume the uninterrupted trajectory. Trainer rank 0 talks to the engines and broadcasts what it receives to
the other trainer ranks (gloo objects over the trainer's default group).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.errors import UserError
from dapo_mcore.rollout.bridge import Bridge
from dapo_mcore.rollout.groups import GroupData
from dapo_mcore.rollout.protocol import EngineError, WeightBucket
from dapo_mcore.rollout.source import StepBatch
from dapo_mcore.signals import faults
from dapo_mcore.telemetry.evaluation import eval_after

log = logging.getLogger(__name__)

__all__ = ["AsyncRollouts", "PENDING_FILE", "flatten_bucket", "rebucket", "unflatten_bucket"]

PENDING_FILE = "rollouts_pending.pkl"
"""In an async run's checkpoint: the batch the engines generated for the step after it (and their state after it)."""


def rebucket(buckets: Iterable[WeightBucket], limit: int) -> Iterator[WeightBucket]:
    """The same tensors in the same order, in buckets of at most ``limit`` bytes (one tensor may exceed it alone)."""
    from dapo_mcore.weights.export import bucketed

    return bucketed((pair for bucket in buckets for pair in bucket), limit)


def flatten_bucket(bucket: WeightBucket) -> tuple[list[tuple[str, tuple[int, ...], str]], torch.Tensor]:
    """A bucket's tensors as one byte buffer (any mix of dtypes) and what it takes to cut it up again."""
    meta = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
    flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket])
    return meta, flat


def unflatten_bucket(meta: list[tuple[str, tuple[int, ...], str]], flat: torch.Tensor) -> WeightBucket:
    out, start = [], 0
    for name, shape, dtype in meta:
        dt = getattr(torch, dtype)
        size = dt.itemsize * (int(torch.Size(shape).numel()))
        out.append((name, flat[start:start + size].view(dt).view(shape)))
        start += size
    if start != flat.numel():
        raise EngineError(f"weight transfer: a bucket of {flat.numel()} bytes holds {start} bytes of tensors")
    return out


def _is_failure(value: Any) -> bool:
    """``_read``'s result when the engines reported a failure instead of what was waited for."""
    return isinstance(value, dict) and set(value) == {"error"}


def _broadcast(value: Any, root: bool) -> Any:
    """Trainer rank 0's ``value`` (a batch message, an evaluation's groups, a failure) on every trainer rank, packed
    (``rollout.wire``) and sent as tensors on the trainer group's device."""
    from dapo_mcore.collectives.device import collective_device
    from dapo_mcore.rollout import wire

    device = collective_device()
    sizes = device.to(torch.zeros(3, dtype=torch.int64))
    if root:
        message = ({"groups": value} if isinstance(value, list) else
                   wire.light(value) if isinstance(value, dict) and "batch" in value else {"value": value})
        packed = wire.pack(message, routes=False)  # each trainer rank fetches its own (actor.route_exchange)
        parts = [torch.frombuffer(bytearray(packed.meta), dtype=torch.uint8), packed.token_ids, packed.logprobs]
        sizes = device.to(torch.tensor([t.numel() for t in parts], dtype=torch.int64))
    dist.broadcast(sizes, src=0)
    if not root:
        parts = [torch.empty(int(n), dtype=dt) for n, dt in zip(device.host(sizes).tolist(),
                                                                (torch.uint8, torch.int32, torch.float32), strict=True)]
    parts = [device.to(t) for t in parts]
    for t in parts:
        if t.numel():
            dist.broadcast(t, src=0)
    if root:
        return value
    parts = [device.host(t) for t in parts]
    got = wire.unpack(wire.Packed(parts[0].numpy().tobytes(), parts[1], parts[2]))
    return got["groups"] if set(got) == {"groups"} else got["value"] if set(got) == {"value"} else got


class AsyncRollouts:
    """The trainer ranks' RolloutSource in async mode (module docstring)."""

    colocated = False

    def __init__(self, cfg: Any, bridge: Bridge, timer: Any) -> None:
        self.cfg, self.bridge, self.timer = cfg, bridge, timer
        self.is_root = bridge.role.rank == 0
        self.version: int | None = None
        """The last version published (None before the first)."""
        self.fresh_start = True
        self.resume_state: dict[str, Any] | None = None
        self._batches: dict[int, dict[str, Any]] = {}
        self._evals: dict[int, list[GroupData]] = {}
        self.engine_state: dict[str, Any] = {}
        """The sampler/schedule state after the latest batch received (what a checkpoint stores)."""
        self.last: dict[str, float] = {}
        """The latest step's pipeline seconds (trainer waits, engine waits, transfers)."""
        self._start = 0
        """The version of the first publish: the steps the run starts after."""
        self._stopped = False
        self._pending_at_start = False
        """The checkpoint resumed from holds the next batch (not after the last step of a run now extended)."""
        self._mid_version = False
        """A publish failed between its first and last broadcast: the engines wait for a bucket, not a meeting."""
        self.behind = os.environ.get("DAPO_MCORE_EVAL_INLINE") != "1"
        """Evaluations run behind the trainer (module docstring); off: the trainer waits for each after its step."""
        self._late: int | None = None
        """The version the engines evaluate behind the trainer, taken at the next publish (every trainer rank)."""
        self._arrived: tuple[int, Any] | None = None
        """That evaluation once taken (trainer rank 0: its groups or the engines' failure), until ``late_eval``."""
        self._engines_failed = False

    # ---- start and checkpoints -------------------------------------------------------------------------------
    def resume_from(self, step: int, state: dict[str, Any], pending: bytes | None) -> None:
        """A checkpoint after ``step`` steps: the engines start from its state, the trainer trains on its batch."""
        self.fresh_start = step == 0
        self._pending_at_start = pending is not None
        if pending is not None:
            message = pickle.loads(pending)
            self._batches[message["step"]] = message
            self.engine_state = message["state"]
            was = message.get("engine_ranks")
            if was is not None and was != self.bridge.role.engine_ranks:
                log.info("resuming with rollout.pipeline.engine_ranks=%d (the checkpoint's batches came from %d): "
                         "step %d trains on the checkpoint's batch; from the batch after it the engine groups "
                         "differ, and so does the trajectory", self.bridge.role.engine_ranks, was, step + 1)
        self.resume_state = {"sampler": state.get("sampler"), "schedule": state.get("schedule")}
        self.version = None
        self._start = step

    def checkpoint_payload(self, step: int) -> tuple[dict[str, Any], bytes | None]:
        """Collective over the trainer ranks, after ``step`` steps: the state after the next batch and that batch
        (trainer rank 0 receives it now: the engines have it ready once version ``step`` was published; the other
        ranks get nothing). Nothing is pending after the last step."""
        if step >= self.cfg.train.steps:
            return self.engine_state, None

        def receive() -> Any:
            got = self._read(lambda: self._batches.get(step))
            return got if _is_failure(got) else True

        self._shared(receive)  # raises on every rank if the engines failed
        if not self.is_root:
            return {}, None
        message = self._batches[step]
        return message["state"], pickle.dumps(message)

    # ---- the interface --------------------------------------------------------------------------------------
    @property
    def weights_valid(self) -> bool:
        return True

    def wake(self) -> None:
        """The engines have their own devices: nothing to wake."""

    def sleep(self) -> None:
        """The engines have their own devices: nothing to put to sleep."""

    def snapshot(self) -> Any:
        return None

    def rollback(self, snap: Any) -> None:
        """Never needed: the trainer does not abandon a step in async mode (the engines' work is regenerated from
        the checkpoint's state)."""

    def publish(self, weights: Iterable[WeightBucket]) -> None:
        """Every trainer rank iterates the export (a collective for TP/PP); trainer rank 0 sends each bucket. Returns
        once the engines hold the version, i.e. once they finished the batch this version follows."""
        start = self._start
        version = start if self.version is None else self.version + 1
        t0 = time.monotonic()
        due, previous = self._eval_due(version), self._late
        self._late = version if due and self.evaluates_behind(version) else None
        self._arrived = None if previous is None else (previous, None)
        if not self.is_root:
            for _ in weights:
                pass
            self.version = version
            return
        header = {"version": version, "eval": due}
        if self.version is None:
            header.update(start=start, state=self.resume_state, pending=self._pending_at_start)
        if previous is not None:  # the engines send it before they generate on: take it, then meet
            self._arrived = (previous, self._read(lambda: self._evals.pop(previous, None)))
            self._waited(time.monotonic() - t0, "trainer_wait_eval_s")
            t0 = time.monotonic()
        self.bridge.meet()  # the engines finished the batch before this version (Bridge.meet)
        self._mid_version = True
        self.bridge.broadcast_header(header)
        if self.version is not None:  # returns once the engines join: they finished the next batch
            self._waited(time.monotonic() - t0, "trainer_wait_publish_s")
        for index, bucket in enumerate(rebucket(weights, int(self.cfg.rollout.pipeline.bucket_mb * (1 << 20)))):
            meta, flat = flatten_bucket(bucket)
            self.bridge.broadcast_header({"bucket": meta, "bytes": flat.numel()})
            self.bridge.broadcast_flat(flat)
            faults.point("publish", version, index)
        self.bridge.broadcast_header({"end": True})
        self._mid_version = False
        self.version = version

    def _eval_due(self, version: int) -> bool:
        """Whether the engines evaluate ``version`` once they hold it. The start's version only at a fresh start
        (eval.at_start) or when the run resumes from an eval step's checkpoint whose evaluation ran behind the trainer
        (module docstring): otherwise it was evaluated before the checkpoint, and an evaluation nobody reads would
        block the engines' channel."""
        if self.version is not None:
            return eval_after(self.cfg, version, False)
        if version == 0:
            return eval_after(self.cfg, 0, self.fresh_start)
        return self.evaluates_behind(version) and self._pending_at_start and eval_after(self.cfg, version, False)

    def late_eval(self) -> tuple[int, list[GroupData]] | None:
        """Collective over the trainer ranks, after a publish: the evaluation that ran behind the trainer and
        arrived in it, as (version, groups) on every trainer rank, or None. An engine failure raises on all."""
        if self._arrived is None:
            return None
        version, value = self._arrived
        self._arrived = None
        return version, self._shared(lambda: value)

    def evaluates_behind(self, step: int) -> bool:
        """The evaluation after ``step`` steps (an eval step) runs behind the trainer and arrives with the next step
        (``late_eval``), whose line must hold no evaluation of its own (one per line): not version 0 nor the last
        (nothing trains beside them), nor the one before the last, nor any with ``eval.every: 1``."""
        return self.behind and self.cfg.eval.every > 1 and 0 < step < self.cfg.train.steps - 1

    def step_batch(self, step: int, stop: Callable[[], bool]) -> StepBatch:
        """Batch ``step`` from the engines (rank 0 receives it, the other trainer ranks get it from rank 0)."""
        t0 = time.monotonic()
        with self.timer.phase("wait_rollouts"):
            message = self._shared(lambda: self._read(lambda: self._batches.pop(step, None)))
        self.engine_state = message["state"]
        self.last = {"trainer_wait_s": 0.0, **message["seconds"]}
        self._waited(time.monotonic() - t0, "trainer_wait_batch_s")
        batch: StepBatch = message["batch"]
        batch.policy_version, batch.prefix_version = message["version"], message["prefix_version"]
        return batch

    def _waited(self, seconds: float, part: str) -> None:
        """This step's trainer wait for the engines, once: receiving the batch (``wait_rollouts``) and, inside the
        publish (the trainer's ``sync_weights`` phase), until the engines join it having finished the next batch:
        that part (and the wait for an evaluation behind the trainer) is charged to ``wait_rollouts``, so
        ``sync_weights`` is the transfer alone."""
        if part in ("trainer_wait_publish_s", "trainer_wait_eval_s"):
            self.timer.move("sync_weights", "wait_rollouts", seconds)
        self.last[part] = seconds
        self.last["trainer_wait_s"] = self.last.get("trainer_wait_s", 0.0) + seconds

    def eval_groups(self, records: list[Any], step: int) -> list[GroupData]:
        return self._shared(lambda: self._read(lambda: self._evals.pop(step, None)))

    def close(self) -> None:
        """Tell the engines to stop (trainer rank 0), then wait for every rank at the shutdown barrier."""
        if self._stopped:
            return
        self._stopped = True
        if self.is_root:
            if self._late is not None and not self._mid_version and not self._engines_failed:
                self._read(lambda: self._evals.pop(self._late, None))  # the engines send it before they meet
            if not self._mid_version:
                self.bridge.meet()
            self.bridge.broadcast_header({"stop": True})
        self.bridge.barrier()
        self.bridge.close()

    # ---- the batches channel ---------------------------------------------------------------------------------
    def _read(self, found: Callable[[], Any]) -> Any:
        """Trainer rank 0: receive messages (batches, evaluations, errors, in the engines' order) until ``found``."""
        while (hit := found()) is None:
            message = self.bridge.recv_object()
            kind = message["kind"]
            if kind == "batch":
                self._batches[message["step"]] = message
            elif kind == "eval":
                self._evals[message["version"]] = message["groups"]
                self.last["engine_eval_s"] = message["seconds"]
            else:
                self._engines_failed = True
                return {"error": message}
        return hit

    def _shared(self, read: Callable[[], Any]) -> Any:
        """``read()`` on trainer rank 0, its result on every trainer rank; an engine-side failure raises on all.
        A batch reaches the other ranks light (``wire.light``: the kept groups whole) and packed as tensors."""
        value = read() if self.is_root else None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.bridge.hold_trainers(self.is_root)  # the others wait on the store, not in the broadcast
            value = _broadcast(value, self.is_root)
        if _is_failure(value):
            self._raise(value["error"])
        return value

    @staticmethod
    def _raise(message: dict[str, Any]) -> None:
        from dapo_mcore.algo.dynamic_sampling import DynamicSamplingExhausted, SamplingStats

        if message["error"] == "exhausted":
            raise DynamicSamplingExhausted(message["message"], message.get("stats") or SamplingStats())
        if message["error"] == "user":
            raise UserError(f"on the engine ranks: {message['message']}")
        raise EngineError(f"on the engine ranks: {message['message']}")
