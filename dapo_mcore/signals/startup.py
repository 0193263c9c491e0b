"""Ctrl-C during a distributed run's start-up: every rank exits 130 at once, with one line and no traceback.

Start-up (imports, the model and engine builds, the barriers and the bridge's meetings before the first version)
spends long stretches inside C++ calls (a store wait, a gloo barrier) where a Python signal handler never runs: a
rank that got SIGINT there went on waiting until torchrun killed it, and the others printed ``KeyboardInterrupt``
tracebacks through whatever they were importing or building. ``arm()`` blocks SIGINT in the main thread (and in
every thread started after it) and a watcher thread takes it with ``sigtimedwait``: one line, then exit 130
(``os._exit``: before the first step nothing of the run can be lost; a resume finds its last checkpoint as it was).

``disarm()`` ends start-up: the run's own handling applies from then on (the trainer checkpoints after the step and
exits 130, the engines wait for its stop). In async mode both sides disarm as the first version's meeting returns
(``Bridge.meet``), so neither leaves while the other waits for it; ``record=True`` keeps a SIGINT that arrives
before the trainer's handler is installed for it (``interrupted``). Only under torchrun/srun (``RANK`` set) and
only for ``train``; a lone process's Ctrl-C is ``cli.entry``'s one line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["LINE", "arm", "disarm", "interrupted"]

LINE = ("dapo-mcore: interrupted (Ctrl-C) during start-up, before the first step: nothing was lost; run the same "
        "command to start (or resume) the run")
STOP_LINE = ("dapo-mcore: {name} during start-up{sender}, before the first step: nothing was lost; exiting 75 so a "
             "scheduler requeues the job (the same command starts or resumes the run)")
"""SIGTERM (scancel, a pre-emption), SIGUSR1 (Slurm's warning) or SIGHUP (a closed terminal) before the first step:
what the trainer answers after a step (checkpoint, 75) is, before any step, just the exit code. ``{sender}``: who sent
it (`sender`), so a stop nobody expected can be traced to its source."""
STOPS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
WATCHED = {signal.SIGINT, *STOPS}

_watcher: threading.Thread | None = None
_stop = threading.Event()
_interrupted = False
_recorded: int | None = None


def arm(report: Callable[[str], None]) -> None:
    """Start-up begins: SIGINT goes to the watcher (module docstring), which reports ``LINE`` and exits 130."""
    global _watcher
    if _watcher is not None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started with SIGINT ignored (nohup, &): leave it so
        return
    _stop.clear()
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    _watcher = threading.Thread(target=_watch, args=(report,), name="dapo-mcore-startup-sigint", daemon=True)
    _watcher.start()


def _watch(report: Callable[[str], None]) -> None:
    while not _stop.is_set():
        got = signal.sigtimedwait(WATCHED, 0.1)
        if got is None:
            continue
        interrupt = got.si_signo == signal.SIGINT
        try:
            report(LINE if interrupt else STOP_LINE.format(name=signal.Signals(got.si_signo).name, sender=sender(got)))
            sys.stderr.flush()
        finally:
            os._exit(130 if interrupt else 75)


_SI_USER, _SI_TKILL, _SI_QUEUE = 0, -6, -1  # <asm-generic/siginfo.h>: kill(2), tgkill(2), sigqueue(3)


def sender(info: signal.struct_siginfo) -> str:
    """The line's ``{sender}``: " (sent by pid N: its name)" for a signal a process sent (kill, killpg, tgkill,
    sigqueue), " (sent by the kernel)" for one the kernel raised (a terminal's hang-up, an orphaned process group): a
    stop nobody expected then names its source. The name is /proc's, read at once (left out if the sender is gone)."""
    if info.si_code not in (_SI_USER, _SI_TKILL, _SI_QUEUE):
        return " (sent by the kernel)"
    try:
        name = Path(f"/proc/{info.si_pid}/comm").read_text().strip()
    except OSError:
        name = ""
    return f" (sent by pid {info.si_pid}{': ' + name if name else ''})"


def disarm(record: bool = False) -> None:
    """Start-up is over: SIGINT reaches the main thread's handler again; ``record``: a handler that notes it for the
    trainer's (``interrupted``) until that one is installed. No-op when not armed."""
    global _watcher
    if _watcher is None:
        return
    _stop.set()
    _watcher.join()
    _watcher = None
    if record:
        for sig in WATCHED:
            signal.signal(sig, _record)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)


def _record(signum: int, frame: object) -> None:
    global _interrupted, _recorded
    _interrupted = signum == signal.SIGINT or _interrupted
    _recorded = _recorded or signum
    code = 130 if signum == signal.SIGINT else 75
    log.warning("%s received as the run starts: it checkpoints after its first step and exits %d",
                signal.Signals(signum).name, code)


def interrupted() -> bool:
    """A SIGINT arrived between ``disarm(record=True)`` and the trainer's own handler."""
    return _interrupted


def recorded() -> int | None:
    """The first stop signal (SIGINT, SIGTERM, SIGUSR1, SIGHUP) between ``disarm(record=True)`` and the trainer's
    own handler, or None."""
    return _recorded
