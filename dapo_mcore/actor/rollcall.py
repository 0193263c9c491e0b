"""Who stopped answering: a roll call over the rendezvous store, for the rank whose collective timed out.

A collective that times out says only that some peer did not answer in time (gloo: ``Timed out waiting 600000ms for
recv operation to complete``); in a ring that peer may be a neighbour that itself waits for the rank that hangs. So at
start-up every rank records its host in the job's rendezvous store (the TCPStore of the ``tcp://MASTER_ADDR:PORT``
rendezvous, served by rank 0's process, or by torchrun's agent) and starts a responder thread with its own store
client, blocked until a roll call is announced. The rank that timed out announces one (`call`) and waits a few seconds:
every live process answers from its responder thread even while its main thread waits in a collective, so the ranks
that do not answer are the ones that hang (stopped, frozen, or holding the interpreter lock). If the store itself does
not answer, the process that serves it (rank 0's under srun) is the one that hangs.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)

PREFIX = "dapo-mcore/rollcall"
ANNOUNCE, END = f"{PREFIX}/announce", b"end"
FOREVER = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Silent:
    """The outcome of a roll call: the ranks (and their hosts) that did not answer, or ``store_down``."""

    ranks: tuple[tuple[int, str], ...]
    store_down: bool = False
    store_addr: str = ""

    def describe(self) -> str:
        if self.store_down:
            return (f"the rendezvous store on {self.store_addr} does not answer either: the process serving it "
                    "(rank 0's) hangs")
        if not self.ranks:
            return "every rank answered a roll call: one is alive but stuck in its main thread (a deadlock?)"
        names = ", ".join(f"rank {rank} on {host}" for rank, host in self.ranks)
        return f"{names} stopped answering (hung: stopped, frozen or stuck)"


class _RollCall:
    def __init__(self, addr: str, port: int, rank: int, world: int, timeout: datetime.timedelta) -> None:
        self.addr, self.port, self.rank, self.world = addr, port, rank, world
        self.host = socket.gethostname()
        self.store_down = False
        self._client = self._connect(timeout)
        self._client.set(f"{PREFIX}/host/{rank}", self.host)
        self._thread = threading.Thread(target=self._respond, name="dapo-rollcall", daemon=True)
        self._thread.start()

    def _connect(self, timeout: datetime.timedelta) -> dist.TCPStore:
        return dist.TCPStore(self.addr, self.port, None, False, timeout)

    def _respond(self) -> None:
        try:
            self._client.wait([ANNOUNCE], FOREVER)
            if self._client.get(ANNOUNCE) != END:
                self._client.set(f"{PREFIX}/here/{self.rank}", self.host)
        except dist.DistError as exc:  # the store went away (rank 0 exited): no roll call can come any more
            log.debug("roll-call responder of rank %d stops: %s", self.rank, exc)

    def call(self, wait_s: float) -> Silent:
        """Announce a roll call; the ranks that do not answer within ``wait_s`` seconds.

        In a thread with a deadline: a client of a store whose process is frozen waits forever in its connect,
        whatever its timeout says (torch 2.13, measured), so no answer by then means the store is down.
        """
        result: list[Silent] = []
        _bounded(lambda: result.append(self._call(wait_s)), 2 * wait_s + 1)
        if not result:
            self.store_down = True
            return Silent((), store_down=True, store_addr=f"{self.addr}:{self.port}")
        return result[0]

    def _call(self, wait_s: float) -> Silent:
        try:
            client = self._connect(datetime.timedelta(seconds=wait_s))
            client.set(ANNOUNCE, f"call by rank {self.rank}")
            missing, deadline = set(range(self.world)), time.monotonic() + wait_s
            while missing and time.monotonic() < deadline:
                missing = {r for r in missing if not client.check([f"{PREFIX}/here/{r}"])}
                time.sleep(0.1)
            hosts = {r: client.get(f"{PREFIX}/host/{r}").decode() if client.check([f"{PREFIX}/host/{r}"])
                     else "?" for r in missing}
        except dist.DistError as exc:  # set or get timed out: the store's process does not answer
            log.debug("roll call failed: %s", exc)
            self.store_down = True
            return Silent((), store_down=True, store_addr=f"{self.addr}:{self.port}")
        return Silent(tuple(sorted(hosts.items())))

    def end(self) -> None:
        """Release every rank's responder and wait for this one's thread to finish.

        At exit: a thread still blocked in the store's wait when the interpreter finalizes would be torn down inside
        C++ code once the store's process exits (pthread_exit through pybind11, which aborts the process).
        """
        if self._thread.is_alive() and not self.store_down:
            _bounded(self._release, 2.0)  # a client of its own: the responder's is blocked in its wait
        self._thread.join(timeout=2)

    def _release(self) -> None:
        try:
            self._connect(datetime.timedelta(seconds=2)).set(ANNOUNCE, END)
        except dist.DistError as exc:
            log.debug("roll call end: %s", exc)


def _bounded(fn: Callable[[], object], seconds: float) -> bool:
    """Run ``fn`` in a daemon thread for at most ``seconds``; whether it finished (else it is left blocked)."""
    thread = threading.Thread(target=fn, name="dapo-rollcall-call", daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    return not thread.is_alive()


_ACTIVE: _RollCall | None = None


def start(addr: str, port: int, rank: int, world: int, timeout: datetime.timedelta) -> None:
    """Record this rank's host and start its responder (after the process group is up; a new rendezvous replaces
    the previous one's)."""
    global _ACTIVE
    if world > 1 and (_ACTIVE is None or (_ACTIVE.addr, _ACTIVE.port) != (addr, port)):
        if _ACTIVE is None:
            atexit.register(end)
        _ACTIVE = _RollCall(addr, port, rank, world, timeout)


def call(wait_s: float = 5.0) -> Silent | None:
    """The ranks that stopped answering, or None where no roll call runs (one process, or not started)."""
    return None if _ACTIVE is None else _ACTIVE.call(wait_s)


def end() -> None:
    """Stop the roll call (a normal shutdown; also at exit)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.end()
        _ACTIVE = None
