"""One run per run directory: the run lock, held by rank 0 for the whole of ``train``.

Two ``train`` processes on one directory (a double submit, a Slurm requeue racing a manual restart) would truncate
and delete each other's files: the second start rewrites ``metrics.jsonl`` while the first appends to the old
one, or removes the first's ``*.partial`` checkpoint. So rank 0 takes ``RUN_DIR/.run.lock`` before anything in the
directory is truncated or deleted, and keeps it until the run ends; a second holder is refused in one line naming
the first (host, pid, Slurm job id, start time: written into the lock file).

The lock is ``flock`` on that file: the kernel drops it when the holding process dies, however it dies (kill -9,
OOM), so a requeued job always gets it, and a stale lock file of a dead run is just overwritten. It belongs to the
open file, so nothing else in the process can drop it by closing another descriptor of the file, and a second
claim from the same process conflicts like any other. The descriptor is close-on-exec, so the reward pool's
spawned workers never hold it. Across hosts it works where the file system shares locks: NFS (Linux maps flock to
NFS byte-range locks: NFSv4, or v3 with lockd) and Lustre mounted with ``-o flock``; on NFS a holder whose host
crashed keeps it until the server's lease expires (NFSv4: ~90 s). A file system that cannot lock (Lustre without
``-o flock``, NFS without lockd) is refused with the fix, and ``run.lock=false`` runs without the guard there.
``-o localflock`` (Lustre) locks only within one node: two jobs on different nodes would both get it.

Every rank agrees on the outcome: rank 0 tries, and broadcasts what happened over the process group, so a refused
job stops on all ranks with the same line before any of them touches the directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from dapo_mcore.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"

_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class RunLockedError(UserError):
    """The run directory is held by another live run (or cannot be locked on this file system)."""


class RunLock:
    """A held run lock; :meth:`release` (idempotent) frees it, and so does the death of this process."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)  # closing the descriptor drops the lock; the file stays (the next holder rewrites it)


def holder_of(path: Path) -> str:
    """Who the lock file says holds it: ``host node1, pid 4242, Slurm job 1234, since 2026-12-01 21:00:00 UTC``."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return f"a process that has not written {path} yet"
    parts = [f"host {info.get('host', '?')}", f"pid {info['pid']}"]
    if info.get("slurm_job_id"):
        parts.append(f"Slurm job {info['slurm_job_id']}")
    if info.get("started"):
        parts.append(f"since {info['started']}")
    return ", ".join(parts)


def _identity() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def acquire(run_dir: Path) -> RunLock:
    """Take the lock of ``run_dir`` (created if missing) or raise RunLockedError naming its holder."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunLockedError(f"run directory {run_dir} is in use by another run ({holder_of(path)}); wait "
                                 "for it to end or stop it, or use another run.dir") from None
        if err.errno in _NO_LOCKS:
            raise RunLockedError(f"{path}: the file system cannot lock files ({err.strerror}), so two runs on "
                                 "this directory cannot be told apart; mount it with locking (Lustre: -o flock, "
                                 "NFS: lockd or NFSv4) or set run.lock=false and start one run at a time") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_identity()) + "\n").encode(), 0)
    return RunLock(path, fd)


def claim(run_dir: Path, rank: int, enabled: bool = True) -> RunLock | None:
    """Collective over the default process group (if any): rank 0 takes the lock, every rank learns the outcome.

    Returns the lock on rank 0 (None elsewhere, or when ``enabled`` is False); raises the same RunLockedError on
    every rank when rank 0 was refused, and re-raises rank 0's own error there (the others get a line naming it).
    """
    import torch.distributed as dist

    lock, error, outcome = None, None, None
    if rank == 0 and enabled:
        try:
            lock = acquire(run_dir)
        except Exception as exc:  # every rank must hear of it before rank 0 re-raises, or they would wait forever
            error, outcome = exc, (isinstance(exc, RunLockedError), str(exc))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if error is not None:
        raise error
    if outcome is not None:
        refused, message = outcome
        raise RunLockedError(message if refused else f"rank 0 could not lock the run directory {run_dir}: {message}")
    if lock is not None:
        log.info("run directory %s locked by this run (%s)", run_dir, lock.path)
    return lock
