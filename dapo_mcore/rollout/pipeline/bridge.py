"""The async mode's split job: trainer ranks and engine ranks, each with its own default process group, and the
bridge between them.

One torchrun/srun job of N ranks. The last ``engine_ranks`` ranks are the engines, the others the trainer. All of
them rendezvous once on the job's store (``torch.distributed.rendezvous``, the same ``tcp://MASTER_ADDR:MASTER_PORT``
the synchronous mode uses), then each side creates its default process group over its own ranks under its own
store prefix, so Megatron-Core on the trainer side sees a world of trainer ranks only, and the engines' collectives
(sharing responses, scoring once) stay among the engines. Three more groups, under their own prefixes:

    all      every rank: start-up and shutdown barriers
    weights  trainer rank 0 + every engine rank: each policy version, broadcast from trainer rank 0 (NCCL on GPU)
    batches  trainer rank 0 + engine rank 0: each step's batch and each evaluation, sent by the engines (gloo)

Before each version (and the stop) the members of the weights group meet on the store (``Bridge.meet``), which has
no timeout: a collective is enqueued only once every member is there, so a generation or a training step longer than
``parallel.timeout_minutes`` does not time the broadcast out (a rank that died is named by the roll call).

The trainer side's default group is NCCL on a GPU; the engine side's is gloo everywhere: what the engine ranks
exchange among themselves (responses, scores, streaming ticks) is host data, and with the weights group their only
NCCL communicator of ours, the version receiver's thread (bounded staleness) never drives an NCCL communicator beside
another one of ours driven by the loop's thread. NCCL makes no progress guarantee for two communicators whose
operations two ranks issue in different orders (a kernel waiting for its peers can hold the device); the receiver's
broadcasts and the loop's collectives, two threads, would be issued in whatever order each rank's timing gave.
vLLM's own communicators (tensor parallel inside its forward) are vLLM's: the receiver's broadcasts run beside them
on a stream of their own, which NCCL allows where both fit on the device (docs/rollout.md).

Everything is torch.distributed process groups inside the one job: no service, no RPC, no broker.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dapo_mcore.actor.parallel import LaunchEnv, choose_backend
from dapo_mcore.collectives.device import TransferDevice, strict, transfer_device

log = logging.getLogger(__name__)

__all__ = ["Bridge", "Role", "init_split_world", "role_of"]


@dataclass(frozen=True)
class Role:
    """Where a rank of the async job sits."""

    trainer: bool
    rank: int
    """Rank within its side (the default process group's rank)."""
    size: int
    """Ranks on its side."""
    engine_ranks: int


def role_of(launch: LaunchEnv, engine_ranks: int) -> Role:
    trainers = launch.world_size - engine_ranks
    if launch.rank < trainers:
        return Role(True, launch.rank, trainers, engine_ranks)
    return Role(False, launch.rank - trainers, engine_ranks, engine_ranks)


def _group(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    if backend == "nccl":  # GPU only; not run in this project's CI (docs/rollout.md says what has run)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class Bridge:
    """The groups between the two sides (module docstring) and the few verbs the async mode needs."""

    def __init__(self, role: Role, all_pg: Any, weights_pg: Any | None, batches_pg: Any | None,
                 device: TransferDevice, store: Any = None, poll: datetime.timedelta = datetime.timedelta(minutes=10)):
        self.role, self.all_pg, self.weights_pg, self.batches_pg = role, all_pg, weights_pg, batches_pg
        self.device = device
        """Where every tensor on the weights group travels: cuda with NCCL (which refuses any other), cpu with gloo."""
        self.store, self.poll = store, poll
        """The meetings' store (the job's, under its own prefix) and how often a waiting member calls the roll."""
        self._meetings = 0
        self._shared = 0

    def hold_trainers(self, root: bool) -> None:
        """Before trainer rank 0 shares what it received from the engines (a batch, an evaluation): the other
        trainer ranks wait for it on the store, without a timeout, as ``meet`` does, so that the first batch (an
        evaluation at start and a whole generation) or any generation longer than ``parallel.timeout_minutes``
        does not time out the trainer group's broadcast (an NCCL collective on a GPU)."""
        self._shared += 1
        key = f"trainer/shared/{self._shared}"
        if root:
            self.store.set(key + "/all", b"1")
        else:
            self._wait_all(key)

    @property
    def sends_batches(self) -> bool:
        """Engine rank 0: the engines' voice on the batches group."""
        return not self.role.trainer and self.role.rank == 0

    @property
    def on_weights(self) -> bool:
        return self.weights_pg is not None

    # ---- batches: engine rank 0 -> trainer rank 0 ---------------------------------------------------------------
    def send_object(self, message: dict[str, Any]) -> None:
        """A message (batch, evaluation, error): its tokens and log-probs as tensors, the rest pickled (``wire``)."""
        self.send_packed(self.pack(message))

    @staticmethod
    def pack(message: dict[str, Any]) -> Any:
        """``message`` as it travels (``rollout.pipeline.wire``): what ``send_packed`` sends."""
        from dapo_mcore.rollout.pipeline import wire

        return wire.pack(message)

    def send_packed(self, packed: Any) -> None:
        """A packed message; returns once trainer rank 0 has received it (a gloo send waits for the receive)."""
        sizes = torch.tensor([len(packed.meta), packed.token_ids.numel(), packed.logprobs.numel(),
                              packed.routes.numel()], dtype=torch.int64)
        self.batches_pg.send([sizes], 0, 0).wait()
        for tag, t in enumerate((torch.frombuffer(bytearray(packed.meta), dtype=torch.uint8), packed.token_ids,
                                 packed.logprobs, packed.routes), start=1):
            if t.numel():
                self.batches_pg.send([t], 0, tag).wait()

    def recv_object(self) -> dict[str, Any]:
        from dapo_mcore.rollout.pipeline import wire

        sizes = torch.zeros(4, dtype=torch.int64)
        self.batches_pg.recv([sizes], 1, 0).wait()
        parts = [torch.empty(int(n), dtype=dt) for n, dt in zip(sizes.tolist(), (torch.uint8, torch.int32,
                                                                                   torch.float32, torch.uint8),
                                                                  strict=True)]
        for tag, t in enumerate(parts, start=1):
            if t.numel():
                self.batches_pg.recv([t], 1, tag).wait()
        return wire.unpack(wire.Packed(parts[0].numpy().tobytes(), parts[1], parts[2], parts[3]))

    # ---- weights: trainer rank 0 -> every engine rank -----------------------------------------------------------
    def broadcast_header(self, header: dict[str, Any] | None) -> dict[str, Any]:
        """Trainer rank 0 passes the header; every engine rank gets it. Both tensors travel on the group's device
        (NCCL refuses host tensors); the sender does not wait on the host for them (``broadcast_flat`` does)."""
        root = self.role.trainer
        payload = pickle.dumps(header) if root else b""
        size = self.device.to(torch.tensor([len(payload)], dtype=torch.int64))
        self.weights_pg.broadcast([size], _root()).wait()
        data = (self.device.to(torch.frombuffer(bytearray(payload), dtype=torch.uint8)) if root
                else self.device.empty(int(size.item()), torch.uint8))
        self.weights_pg.broadcast([data], _root()).wait()
        return header if root else pickle.loads(data.cpu().numpy().tobytes())

    def broadcast_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """One bucket's tensors flattened into one buffer, sent from the host or the device (moved here) by trainer
        rank 0, filled in on the receivers (``empty_flat``). The sender waits on the host once per bucket, so at
        most one bucket is in flight (``TransferDevice.synchronize``)."""
        if self.role.trainer:
            flat = self.device.to(flat)
        self.weights_pg.broadcast([flat], _root()).wait()
        if self.role.trainer:
            self.device.synchronize()
        return flat

    def empty_flat(self, numel: int) -> torch.Tensor:
        """A receiver's buffer for one bucket, on the group's device."""
        return self.device.empty(numel, torch.uint8)

    def meet(self) -> None:
        """Trainer rank 0 and every engine rank, before each version's (or the stop's) first broadcast: wait until
        all of them are here, on the store and without a timeout (module docstring). Every ``poll`` of waiting the
        roll is called: a rank that stopped answering ends the wait with its name."""
        self._meetings += 1
        key = f"meet/{self._meetings}"
        if self.store.add(key, 1) == self.role.engine_ranks + 1:
            self.store.set(key + "/all", b"1")
        else:
            self._wait_all(key)
        if self._meetings == 2:  # the first version's: both sides are up, start-up is over (dapo_mcore.signals.startup)
            from dapo_mcore.signals import startup

            startup.disarm(record=self.role.trainer)

    def _wait_all(self, key: str) -> None:
        from dapo_mcore.actor import rollcall

        waited = datetime.timedelta(0)
        while True:
            try:
                self.store.wait([key + "/all"], self.poll)
                return
            except dist.DistStoreError:
                waited += self.poll
            silent = rollcall.call()
            if silent is not None and (silent.ranks or silent.store_down):
                raise RuntimeError(f"the async bridge waited {waited} for the other side: {silent.describe()}")
            log.info("async bridge: %s waited %s for the other side (generating or training); every rank answers",
                     "the trainer" if self.role.trainer else f"engine rank {self.role.rank}", waited)

    def barrier(self) -> None:
        self.all_pg.barrier().wait()

    def start(self, refusal: str | None = None) -> str | None:
        """Trainer rank 0 tells the engine ranks whether the run starts (``refusal``: the one line it refused with,
        e.g. another run in the directory); every member returns that. The engines' only word from the trainer before
        the run exists: without it they would see a lost peer and say "run the same command", which is false."""
        if self.weights_pg is None or self._meetings:  # another trainer rank, or told already
            return refusal
        self.meet()
        return self.broadcast_header({"refusal": refusal} if self.role.trainer else None)["refusal"]

    def close(self) -> None:
        """Shut the weights group down (NCCL warns at exit, and may hang there, about a group never shut down);
        idempotent."""
        if self.weights_pg is not None:
            self.weights_pg.shutdown()
            self.weights_pg = None


def _root() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0  # trainer rank 0 is rank 0 of the weights group
    opts.rootTensor = 0
    return opts


def _warm_up(weights_pg: Any | None, device: TransferDevice, nccl_side: bool) -> None:
    """One collective on each NCCL group of this rank now, so that its communicator (NCCL creates it lazily, at the
    first collective) takes its device memory before vLLM takes its fraction of what is free on the engine ranks."""
    if weights_pg is not None:
        weights_pg.broadcast([device.to(torch.zeros(1))], _root()).wait()
    if nccl_side:
        dist.all_reduce(device.to(torch.zeros(1)))


def init_split_world(launch: LaunchEnv, backend: str, timeout_minutes: float, engine_ranks: int) -> tuple[Role, Bridge]:
    """Rendezvous all ranks, create this side's default process group and the bridge groups (module docstring)."""
    role = role_of(launch, engine_ranks)
    backend = choose_backend(backend)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if backend == "gloo":
        from dapo_mcore.model import cpu_compat

        cpu_compat.apply()
    elif torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
    url = f"tcp://{launch.master_addr}:{launch.master_port}?rank={launch.rank}&world_size={launch.world_size}"
    store, _, _ = next(dist.rendezvous(url, timeout=timeout))
    side = "trainer" if role.trainer else "engines"
    # The engine ranks' own collectives (responses shared, scores, streaming ticks) carry host data: gloo, so the
    # weights group, driven by the version receiver's thread, is their only NCCL communicator (module docstring).
    dist.init_process_group(backend=backend if role.trainer else "gloo",
                            store=dist.PrefixStore(f"dapo/{side}/", store), rank=role.rank, world_size=role.size,
                            timeout=timeout)
    if not role.trainer:
        from dapo_mcore.collectives import strict as strict_check

        strict_check.gloo_on_purpose(dist.distributed_c10d._get_default_group())
    all_pg = dist.ProcessGroupGloo(dist.PrefixStore("dapo/all/", store), launch.rank, launch.world_size, timeout)
    from dapo_mcore.actor import rollcall

    rollcall.start(launch.master_addr, launch.master_port, launch.rank, launch.world_size, timeout)  # names a hung rank
    trainers = launch.world_size - engine_ranks
    device = transfer_device(backend)
    weights_pg = batches_pg = None
    if not role.trainer or role.rank == 0:  # weights: trainer rank 0 is rank 0, engine rank i is i + 1
        rank = 0 if role.trainer else role.rank + 1
        weights_pg = strict(_group(backend, dist.PrefixStore("dapo/weights/", store), rank, engine_ranks + 1, timeout),
                            device)
    if role.rank == 0:  # batches: trainer rank 0 and engine rank 0
        batches_pg = dist.ProcessGroupGloo(dist.PrefixStore("dapo/batches/", store), 0 if role.trainer else 1, 2,
                                           timeout)
    _warm_up(weights_pg, device, nccl_side=role.trainer and backend == "nccl")
    log.info("async layout: rank %d on %s is %s rank %d/%d (%d trainer ranks, %d engine ranks, %s)", launch.rank,
             socket.gethostname(), side, role.rank, role.size, trainers, engine_ranks, backend)
    return role, Bridge(role, all_pg, weights_pg, batches_pg, device, dist.PrefixStore("dapo/bridge/", store), timeout)
