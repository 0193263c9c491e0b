"""Build a directory next to its target and rename it into place, so the target is never half written.

The temp directory is ``.<name>.partial-<host>-<pid>-<random>`` beside the target. It is removed on any
exception and on SIGTERM (what Slurm and most schedulers send before SIGKILL). After SIGKILL or a power loss
it stays: the next `atomic_directory` for the same target removes the ones whose owner process on this host
is gone, and names (without touching) those owned by another host. Before the rename every file and the
directory are fsynced, and the parent after it, so a completed rename means the data is on stable storage.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dapo_mcore.weights.errors import OutputPathError, is_output_os_error, output_os_error

log = logging.getLogger(__name__)

_HOST = socket.gethostname().replace("-", "_")


class OutputExistsError(OutputPathError, FileExistsError):
    """The output path already exists (also a FileExistsError, for callers that catch that)."""


class OutputParentMissingError(OutputPathError, FileNotFoundError):
    """The output's parent directory does not exist (also a FileNotFoundError)."""


def check_target_free(target: str | Path) -> Path:
    target = Path(target)
    if target.exists():
        raise OutputExistsError(f"{target} already exists; choose a new output path or remove it first.")
    if not target.parent.is_dir():
        raise OutputParentMissingError(f"the parent directory of {target} does not exist; create it first.")
    return target


def temp_dir_for(target: Path, tag: str | None = None) -> Path:
    return target.parent / f".{target.name}.partial-{_HOST}-{os.getpid()}-{tag or uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove leftover temp dirs of `target` whose owner process (on this host) is gone; return them."""
    removed = []
    for tmp in sorted(target.parent.glob(f".{target.name}.partial-*")):
        parts = tmp.name.rsplit(".partial-", 1)[1].rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            log.warning("%s looks like a leftover of an older conversion; remove it by hand if nothing writes it", tmp)
            continue
        host, pid = parts[0], int(parts[1])
        if host != _HOST:
            log.warning("%s belongs to a conversion on host %s; remove it by hand if that job is gone", tmp, host)
        elif _pid_alive(pid):
            log.warning("%s belongs to running process %d; leaving it", tmp, pid)
        else:
            log.warning("removing %s, left by process %d which no longer runs", tmp, pid)
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def fsync_tree(directory: Path) -> float:
    """fsync every file under `directory`, then the directories bottom-up; returns the seconds it took."""
    start = time.perf_counter()
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))
    return time.perf_counter() - start


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM inside `atomic_directory`, so the cleanup runs."""


def terminating() -> contextlib.AbstractContextManager[None]:
    """Within: SIGTERM raises ``_Terminated`` in the main thread (unless a program installed its own handler), so
    cleanups run and ``stop_signal`` can tell a termination from an error."""
    return _sigterm_raises()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # not ours to take: a thread cannot set handlers
        return
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_stops(previous_hook)
    try:
        with _sigterm_handler():
            yield
    finally:
        sys.unraisablehook = previous_hook


@contextlib.contextmanager
def _sigterm_handler() -> Iterator[None]:
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield  # a program's own handler stays in charge
        return

    def handler(signum, frame):
        raise _Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:  # unless the program set another meanwhile (SIG_IGN once done)
            signal.signal(signal.SIGTERM, previous)


def _redeliver_stops(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable hook. A stop signal whose exception was raised inside a callback Python cannot propagate from (a
    weakref callback of the import lock, a ``__del__``) would be printed as "Exception ignored ... Traceback" and then
    lost, the command running on to exit 0. It is raised again instead, from a short-lived thread a moment later
    (raised here, it would land in this hook and be unraisable again), and ends the command as any stop does.
    Anything else goes to ``previous``."""

    def hook(unraisable: Any) -> None:
        stop = stop_signal(unraisable.exc_value)
        if stop is None:
            previous(unraisable)
            return

        def again() -> None:
            time.sleep(0.01)  # the main thread has left the callback and this hook by then
            signal.raise_signal(stop)  # its Python handler runs in the main thread, in ordinary code

        threading.Thread(target=again, name="stop-again", daemon=True).start()

    return hook


last_fsync_seconds = 0.0  # of the latest atomic_directory (benchmarks report it)


@contextlib.contextmanager
def atomic_directory(target: str | Path, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp dir next to `target`; fsync and rename it to `target` on success, delete it on any error,
    SIGTERM or Ctrl-C (then exit 143 or 130 with one line, like the default action would, even when the unwinding
    raised something else on the way: ``stop_signal``). OSErrors become OutputPathError."""
    global last_fsync_seconds
    target = check_target_free(target)
    remove_stale_partials(target)
    tmp = temp_dir_for(target)
    try:
        tmp.mkdir()
    except OSError as err:
        raise output_os_error(err, target) from err
    renamed = False
    try:
        with _sigterm_raises():
            yield tmp
            last_fsync_seconds = fsync_tree(tmp) if fsync else 0.0
            check_target_free(target)  # created by someone else meanwhile: never rename over it
            os.rename(tmp, target)
            renamed = True
        if fsync:
            fsync_dir(target.parent)
    except BaseException as err:
        if renamed:  # `target` is whole: a signal from here on is the caller's to report, not a removal
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        stop = None if isinstance(err, SystemExit) else stop_signal(err)
        if stop is not None:
            what = "terminated (SIGTERM)" if stop == signal.SIGTERM else "interrupted (SIGINT)"
            log.error("%s: removed %s; %s was not written", what, tmp, target)
            raise SystemExit(128 + stop) from None
        if not isinstance(err, OSError) or isinstance(err, OutputPathError) or not is_output_os_error(err):
            raise
        raise output_os_error(err, target) from err


def stop_signal(exc: BaseException | None) -> int | None:
    """SIGTERM or SIGINT if ``exc`` is, or arose while unwinding from, a stop signal (``_Terminated``,
    ``KeyboardInterrupt``): a buffer still exported by the write in progress raises ``BufferError: cannot close
    exported pointers exist`` on its way out, which hides the signal that started it. None otherwise."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, _Terminated):
            return signal.SIGTERM
        if isinstance(exc, KeyboardInterrupt):
            return signal.SIGINT
        exc = exc.__context__ if exc.__context__ is not None else exc.__cause__
    return None
