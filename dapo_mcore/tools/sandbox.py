"""Runs model-written Python code: in a bubblewrap box (``backend="bwrap"``) or, unboxed, in a plain subprocess.

``Sandbox(...).run(code)`` never raises for anything the code does: a hang, a crash, a memory bomb, an output flood, a
child left behind or a box that fails to start comes back as a :class:`SandboxResult` whose ``kind`` says which
(``ok``, ``error``, ``timeout``, ``truncated``, ``sandbox_failure``). It is safe to call from several threads at once:
each call has its own process, pipes and box.

Per call: rlimits set in the child before bubblewrap starts (address space = ``memory_mb``, CPU seconds, file size,
open files, no core dumps; where the trainer is root, the box runs as nobody under ``max_processes`` too; the box's
processes are the OOM killer's first pick), stdin is /dev/null, stdout and stderr are read as they come and the box is
killed once together they pass ``max_output_bytes`` or the wall time passes ``timeout_s``. The launcher is a session
of its own and the box a pid namespace that dies with it, so killing the launcher's process group leaves nothing
behind. ``docs/tools.md`` is the security model (what is isolated and what is not).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dapo_mcore.tools.box import (
    SAFE_PATH,
    SETUP_FAILURE,
    Interpreter,
    SandboxUnavailable,
    box_env,
    bwrap_argv,
    features,
    filter_fd,
    interpreter,
    probe,
    unavailable,
)

log = logging.getLogger(__name__)

ResultKind = Literal["ok", "error", "timeout", "truncated", "sandbox_failure"]
_PRLIMIT = {resource.RLIMIT_AS: "as", resource.RLIMIT_CPU: "cpu", resource.RLIMIT_FSIZE: "fsize",
            resource.RLIMIT_NOFILE: "nofile", resource.RLIMIT_CORE: "core", resource.RLIMIT_NPROC: "nproc"}
NOBODY = 65534
"""The uid and gid a box runs as when the trainer is root."""
ALL_BOXES_PROCESSES = 4096
"""Where boxes run as nobody: the most processes of nobody on the node, all boxes together (each box: at most
``max_processes``). The kernel counts a box's processes against both: its own user namespace's count, and every
process of nobody on the node."""
OOM_SCORE_ADJ = 1000
"""The box's processes are the first the kernel's OOM killer picks (any process may raise its own score): where
boxes side by side run the node out of memory, box code dies, not the trainer."""
DRAIN_S = 0.5
"""After the code's process exits, how long its pipes may stay open (a child of an unboxed run holding them)."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run of code did."""

    stdout: str
    """Decoded as UTF-8 (invalid bytes replaced); at most ``max_output_bytes`` together with stderr."""
    stderr: str
    """The traceback's last line is the error (``ZeroDivisionError: division by zero``)."""
    exit_code: int | None
    """The code's exit status; negative: killed by that signal; None: killed at the timeout."""
    timed_out: bool
    """The wall time reached ``timeout_s`` and the box was killed."""
    truncated: bool
    """The output reached ``max_output_bytes`` and the box was killed."""
    seconds: float
    """Wall time of the call (the cost ledger's tool seconds)."""
    kind: ResultKind
    """``ok`` (exit 0), ``error`` (non-zero exit), ``timeout``, ``truncated``, ``sandbox_failure`` (the box or the
    process did not start; ``stderr`` says why)."""


class Sandbox:
    """Runs code under a time, memory and output budget, boxed by bubblewrap or (``backend="none"``) unboxed."""

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_bytes: int = 64 * 1024,
                 python: str = "python3", backend: Literal["bwrap", "none"] = "bwrap", *, bwrap: str = "bwrap",
                 max_file_mb: int = 16, max_open_files: int = 256, max_processes: int = 64):
        """``python``: the tool interpreter (a name on PATH or a path; its prefix is visible in the box, read-only):
        give tools an environment of their own, not the trainer's. ``bwrap``: the bubblewrap binary.
        ``max_processes``: the box's process limit, enforced where the trainer runs as root (the box then runs as
        nobody; root ignores the limit) and the interpreter is readable by every user. Raises
        :class:`SandboxUnavailable` (one line) where ``backend="bwrap"`` cannot start a box."""
        if backend not in ("bwrap", "none"):
            raise ValueError(f"sandbox backend {backend!r}: use 'bwrap' or 'none'")
        for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes),
                            ("max_file_mb", max_file_mb), ("max_open_files", max_open_files),
                            ("max_processes", max_processes)):
            if not value > 0:
                raise ValueError(f"sandbox {name}={value!r} must be positive")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.backend = backend
        self.interpreter: Interpreter = interpreter(python)
        self.max_file_bytes = int(max_file_mb) * 1024 * 1024
        self._limits = [(resource.RLIMIT_AS, self.memory_mb * 1024 * 1024),
                        (resource.RLIMIT_CPU, math.ceil(self.timeout_s) + 1),
                        (resource.RLIMIT_FSIZE, self.max_file_bytes),
                        (resource.RLIMIT_NOFILE, int(max_open_files)),
                        (resource.RLIMIT_CORE, 0)]
        self.max_processes = int(max_processes)
        self.unprivileged = False  # the box runs as nobody under max_processes (set by _start_box)
        self._set_launcher(unprivileged=False)
        if backend == "none":
            self._bwrap = ""
            log.warning("rollout.tools.sandbox=none: tool code runs UNBOXED in a plain subprocess (rlimits and an "
                        "empty environment only): it can read and write your files and reach the network")
            return
        found = shutil.which(bwrap, path=os.environ.get("PATH")) if "/" not in bwrap else bwrap
        self._bwrap = found or bwrap
        self._start_box()
        if "--size" not in features(self._bwrap):
            log.warning("this bubblewrap cannot size the box's tmpfs (--size needs bubblewrap 0.8): tool code can "
                        "fill /tmp and /box with files up to half the node's memory each, counted by no limit; "
                        "upgrade bubblewrap")

    def _set_launcher(self, unprivileged: bool, use_prlimit: bool = True) -> None:
        """util-linux's prlimit sets the limits and execs what follows: the trainer spawns with vfork, at a cost that
        does not grow with its memory. Without prlimit, a preexec function sets them between fork and exec; a fork
        copies the page tables of a trainer holding gigabytes (benchmarks/tool_sandbox.py measures both). choom
        (util-linux too) sets the box's OOM score; without it the preexec function does.
        ``unprivileged``: setpriv drops root to nobody first, so that RLIMIT_NPROC (which root ignores) binds: the
        launcher gets the node-wide limit of all boxes, and prlimit inside the box lowers it to ``max_processes``."""
        limits = [*self._limits, *([(resource.RLIMIT_NPROC, ALL_BOXES_PROCESSES)] if unprivileged else [])]
        prlimit = shutil.which("prlimit", path=SAFE_PATH) if use_prlimit else None
        choom = shutil.which("choom", path=SAFE_PATH) if prlimit else None
        self._prefix = [*([prlimit, *(f"--{_PRLIMIT[which]}={value}" for which, value in limits), "--"]
                          if prlimit else []), *([choom, "-n", str(OOM_SCORE_ADJ), "--"] if choom else [])]
        self._preexec = None if choom else functools.partial(_set_limits, [] if prlimit else limits)
        self._inner: tuple[str, ...] = ()
        if unprivileged:
            self._prefix += [shutil.which("setpriv", path=SAFE_PATH) or "setpriv", f"--reuid={NOBODY}",
                             f"--regid={NOBODY}", "--clear-groups", "--"]
            self._inner = (shutil.which("prlimit", path=SAFE_PATH) or "prlimit", f"--nproc={self.max_processes}", "--")
        self.unprivileged = unprivileged

    def _start_box(self) -> None:
        """Probe the box (once per process and setting); as root, first as nobody under the process limit."""
        if os.geteuid() == 0 and shutil.which("setpriv", path=SAFE_PATH) and shutil.which("prlimit", path=SAFE_PATH):
            self._set_launcher(unprivileged=True)
            why = probe(tuple(self._prefix), self._bwrap, self.interpreter, self._inner)
            if why is None:
                return
            self._set_launcher(unprivileged=False)
            if probe(tuple(self._prefix), self._bwrap, self.interpreter) is None:
                log.warning("the tool-code sandbox runs as root, not as nobody (%s): a fork bomb is bounded by the "
                            "timeout only, not by max_processes; give the tools an interpreter every user can read "
                            "and allow unprivileged user namespaces", why)
                return
        why = probe(tuple(self._prefix), self._bwrap, self.interpreter)
        if why is not None:
            raise unavailable(why)

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as a script; every outcome is a result, never an exception."""
        start = time.monotonic()
        size = len(code.encode("utf-8", errors="replace"))
        if size > self.max_file_bytes:  # the code is a file in the box, under the same limit as the files it writes
            return SandboxResult("", f"OSError: the code is {size} bytes, over the file-size limit of the box "
                                 f"(max_file_mb={self.max_file_bytes // 2**20})\n", 1, False, False,
                                 time.monotonic() - start, "error")
        try:
            if self.backend == "bwrap":
                return self._run_bwrap(code, start)
            return self._run_unboxed(code, start)
        except OSError as exc:  # no process: fork failed (EAGAIN, ENOMEM), too many open files, binary gone
            return SandboxResult("", f"sandbox failed to start: {exc}", None, False, False,
                                 time.monotonic() - start, "sandbox_failure")

    def _run_bwrap(self, code: str, start: float) -> SandboxResult:
        fd = os.memfd_create("tool-code", os.MFD_CLOEXEC)
        info_read, info_write = os.pipe()
        seccomp = None
        try:
            os.write(fd, code.encode("utf-8", errors="replace"))
            os.lseek(fd, 0, os.SEEK_SET)
            seccomp = filter_fd()
            argv = bwrap_argv(self._bwrap, self.interpreter, fd, self._inner, info_fd=info_write, seccomp_fd=seccomp)
            proc = subprocess.Popen([*self._prefix, *argv], env=box_env("/"), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    preexec_fn=self._preexec,
                                    pass_fds=(fd, info_write) if seccomp is None else (fd, info_write, seccomp))
        except BaseException:
            os.close(info_read)
            raise
        finally:
            for closing in (fd, info_write, -1 if seccomp is None else seccomp):
                if closing >= 0:
                    os.close(closing)
        try:
            return self._finish(proc, start, functools.partial(_kill_box, proc, info_read))
        finally:
            os.close(info_read)

    def _run_unboxed(self, code: str, start: float) -> SandboxResult:
        workdir = tempfile.mkdtemp(prefix="dapo-tool-")
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            proc = subprocess.Popen([*self._prefix, self.interpreter.path, "-I", "-B", "main.py"], cwd=workdir,
                                    env=box_env(workdir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, preexec_fn=self._preexec)
            return self._finish(proc, start)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)  # the code may have made it unremovable: a temp dir, not data

    def _finish(self, proc: subprocess.Popen, start: float, kill_box: Callable[[], None] | None = None) -> SandboxResult:
        stopped = True
        try:
            out, err, timed_out, truncated = self._collect(proc, start + self.timeout_s)
            stopped = timed_out or truncated
        finally:
            if stopped and kill_box is not None:
                kill_box()
            _kill_group(proc)
        exit_code = None if timed_out else proc.returncode
        stderr = err.decode("utf-8", errors="replace")
        if timed_out:
            kind: ResultKind = "timeout"
        elif truncated:
            kind = "truncated"
        elif exit_code in (1, 126, 127) and stderr.startswith(SETUP_FAILURE) and not out:
            kind = "sandbox_failure"
        else:
            kind = "ok" if exit_code == 0 else "error"
        return SandboxResult(out.decode("utf-8", errors="replace"), stderr, exit_code, timed_out, truncated,
                             time.monotonic() - start, kind)

    def _collect(self, proc: subprocess.Popen, deadline: float) -> tuple[bytes, bytes, bool, bool]:
        """Read stdout and stderr as they come until both close, the deadline passes (timed out) or together they
        pass the cap (truncated). Never more than the cap is held."""
        assert proc.stdout is not None and proc.stderr is not None
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        total, drain_until = 0, None
        with selectors.DefaultSelector() as sel:
            for f in (proc.stdout, proc.stderr):
                os.set_blocking(f.fileno(), False)
                sel.register(f.fileno(), selectors.EVENT_READ)
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), True, False
                if drain_until is None and _exited(proc.pid):
                    drain_until = now + DRAIN_S
                if drain_until is not None and now >= drain_until:
                    break
                for key, _ in sel.select(min(deadline, drain_until or deadline, now + 0.2) - now):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    room = self.max_output_bytes - total
                    bufs[key.fd] += chunk[:room]
                    total += min(len(chunk), room)
                    if len(chunk) > room:
                        return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), False, True
        # both pipes are closed, but code that closed them itself may still run: it gets the rest of its time
        while drain_until is None and not _exited(proc.pid):
            if time.monotonic() >= deadline:
                return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), True, False
            time.sleep(0.01)
        return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), False, False


def _set_limits(limits: list[tuple[int, int]]) -> None:
    """In the child, between fork and exec (where prlimit or choom is missing): plain system calls only. The OOM score
    first: the child still holds every descriptor of the trainer until exec (subprocess closes them after this runs),
    so after RLIMIT_NOFILE the lowest free descriptor may lie above the limit and the open would fail (EMFILE)."""
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    try:
        os.write(fd, b"%d" % OOM_SCORE_ADJ)
    finally:
        os.close(fd)
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def _exited(pid: int) -> bool:
    """Whether the launcher has exited, without reaping it (its pid, the group's id, stays reserved until then)."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None


def _kill_box(proc: subprocess.Popen, info_fd: int) -> None:
    """Kill a running box through its pid 1 (the code; the namespace dies with it), so that its launcher reaps it and
    exits: killing the launcher first would leave the box's pid 1 to the host's init to reap. The pid comes from
    bubblewrap's ``--info-fd``; a pidfd, opened while the launcher (not yet reaped) is still its parent, makes the
    kill reach that process and no other."""
    os.set_blocking(info_fd, False)
    try:
        info = json.loads(os.read(info_fd, 65536) or b"{}")
    except (BlockingIOError, ValueError):
        return  # the box has not started (nothing written yet): the launcher's group kill is all there is to do
    pid = info.get("child-pid")
    if not isinstance(pid, int):
        return
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        if parent == proc.pid:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (OSError, ValueError, IndexError):
        return  # exited while we looked: its launcher reaps it
    finally:
        os.close(pidfd)
    deadline = time.monotonic() + 2.0
    while not _exited(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.005)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's whole process group (it is its own session), then reap it. The group's id cannot have
    been reused: its leader is not reaped before this. A boxed run's box is a pid namespace that dies with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is empty: everything in it has exited already
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


__all__ = ["ResultKind", "Sandbox", "SandboxResult", "SandboxUnavailable"]
