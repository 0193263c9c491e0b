"""What the code sandbox puts in its box: the tool interpreter's directories, the bubblewrap command line, the probe.

The box (bubblewrap) sees the system directories and the tool interpreter's own prefix read-only, a private /tmp and
working directory (``/box``, holding the code as ``main.py``), its own /proc and a minimal /dev, and nothing else of the
host: no home, no checkout, no run directory, no data. Every namespace is new (no network: its loopback is its own and
down), the environment is a fixed minimal one, and the box dies with its launcher.

Whether bubblewrap can run here (installed, user namespaces allowed) is probed once per (binary, interpreter) and
cached; a box that cannot start is refused in one line naming ``rollout.tools.sandbox=none`` (:class:`SandboxUnavailable`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from dapo_mcore.errors import UserError

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""PATH of the launcher, of the code inside the box and of the interpreter's lookup."""

BOX_DIR = "/box"
"""The private working directory inside the box (HOME too); the code is ``/box/main.py``."""

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Read-only in the box (a merged-/usr symlink such as /bin -> usr/bin stays a symlink)."""

ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
"""The few files of /etc the dynamic loader and the interpreter read; no passwd, shadow, hosts or ssl."""

TMPFS_BYTES = 64 * 1024 * 1024
"""Size of each of the box's writable tmpfs (/tmp, /box, /dev/shm): they are memory, so a cap keeps a write loop from
filling the host's RAM."""

SETUP_FAILURE = ("bwrap: ", "prlimit: ", "setpriv: ")
"""The launchers' own error lines start so (bubblewrap exits 1 before running anything; prlimit and setpriv 1, or
126/127 when the command they should run cannot be run or is missing)."""


class SandboxUnavailable(UserError, ValueError):
    """The code sandbox cannot start here (no bubblewrap, no user namespaces, no interpreter); the message says the
    fix and names the setting that runs tool code unboxed. A ValueError too, like the config's own errors, so a
    config check that turns ValueErrors into configuration errors takes it as one."""


def box_env(home: str) -> dict[str, str]:
    """The whole environment of the code (and of bubblewrap itself): nothing of the trainer's."""
    return {
        "PATH": SAFE_PATH, "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
        # one thread per library: tools run in a pool already, and OpenBLAS's per-thread buffers would eat the
        # address-space limit on a many-core node
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg",
    }


@dataclass(frozen=True)
class Interpreter:
    """The tool interpreter: the path to run and the host directories it needs in the box (read-only)."""

    path: str
    """As given (resolved on PATH): a venv's ``bin/python`` stays the venv's, so its ``pyvenv.cfg`` is found."""
    binds: tuple[str, ...]
    """Its prefix(es) and the directory of the real executable, outside the system directories."""


_interpreters: dict[str, Interpreter] = {}
_probes: dict[tuple[tuple[str, ...], str, str, tuple[str, ...]], str | None] = {}
_lock = threading.Lock()


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def interpreter(python: str) -> Interpreter:
    """``python`` (a name on PATH or a path) and the directories to bind for it; cached. Raises SandboxUnavailable."""
    with _lock:
        if python in _interpreters:
            return _interpreters[python]
    found = shutil.which(python, path=SAFE_PATH) if "/" not in python else python
    if found is None or not os.access(found, os.X_OK):
        raise SandboxUnavailable(f"tool interpreter {python!r} not found (looked on {SAFE_PATH}): set "
                                 "rollout.tools.python to the path of a Python with the packages tool code imports "
                                 "(numpy, sympy, ...)")
    # its directory as the box sees it (bound at its real path): a relative path or a symlinked directory resolved,
    # the file's own name kept (a venv's bin/python is a symlink that must stay the venv's)
    found = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(found))), os.path.basename(found))
    query = ("import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
             "sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]))")
    try:
        out = subprocess.run([found, "-I", "-c", query], env=box_env("/"), stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        dirs = [os.path.realpath(p) for p in json.loads(out)]
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        lines = [ln for ln in (getattr(exc, "stderr", None) or str(exc)).splitlines() if ln.strip()]
        raise SandboxUnavailable(f"tool interpreter {found}: cannot run it in an empty environment ({lines[-1]}): "
                                 "set rollout.tools.python to the path of a working Python") from None
    here = os.path.realpath(os.getcwd())
    binds: list[str] = []
    for d in sorted(set(dirs), key=len):
        if d == "/" or _under(here, d):
            raise SandboxUnavailable(f"tool interpreter {found}: its prefix {d} holds the working directory {here}, "
                                     "which the box must not see: give the tools an environment of their own "
                                     "(python3 -m venv /opt/tool-env) and set rollout.tools.python to it")
        if not any(_under(d, s) for s in SYSTEM_DIRS) and not any(_under(d, b) for b in binds):
            binds.append(d)
    found_interpreter = Interpreter(path=found, binds=tuple(binds))
    with _lock:
        _interpreters[python] = found_interpreter
    return found_interpreter


OPTIONAL = ("--disable-userns", "--size", "--clearenv")
"""Options newer bubblewraps have (0.8: --disable-userns, --size); used where ``bwrap --help`` lists them. Without
them the box may create user namespaces of its own, its tmpfs are bounded only by the file-size limit per file,
and its environment is the launcher's (already the minimal one)."""

_features: dict[str, frozenset[str]] = {}


def features(bwrap: str) -> frozenset[str]:
    """Which of :data:`OPTIONAL` this bubblewrap knows (cached; empty if it does not run)."""
    with _lock:
        if bwrap in _features:
            return _features[bwrap]
    try:
        text = subprocess.run([bwrap, "--help"], env=box_env("/"), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    found = frozenset(opt for opt in OPTIONAL if f"{opt} " in text)
    with _lock:
        _features[bwrap] = found
    return found


def bwrap_argv(bwrap: str, interp: Interpreter, code_fd: int, inner: tuple[str, ...] = (),
               info_fd: int | None = None) -> list[str]:
    """The bubblewrap command line that runs ``/box/main.py`` (read from ``code_fd``) under ``interp``, through
    ``inner`` inside the box (the box's own process limit); ``info_fd`` gets the box's host pid (``child-pid``).

    The code is pid 1 of the box's pid namespace (``--as-pid-1``): bubblewrap's own reaper there would outlive the
    launcher by a moment and be left to the host's init to reap (a trainer that is a container's pid 1 never would);
    the launcher reaps the code itself."""
    has = features(bwrap)
    argv = [bwrap, "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", "sandbox"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    if "--disable-userns" in has:  # no user namespace of its own inside: less kernel surface to attack
        argv += ["--unshare-user", "--disable-userns"]
    if "--clearenv" in has:
        argv += ["--clearenv"]
    for key, value in box_env(BOX_DIR).items():
        argv += ["--setenv", key, value]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for f in ETC_FILES:
        argv += ["--ro-bind-try", f, f]
    size = ["--size", str(TMPFS_BYTES)] if "--size" in has else []
    # /dev is a tmpfs bubblewrap makes without a size: read-only (device nodes still work), with a sized /dev/shm
    shm = [*size, "--tmpfs", "/dev/shm"] if size else []
    argv += ["--proc", "/proc", "--dev", "/dev", *shm, "--remount-ro", "/dev",
             *size, "--tmpfs", "/tmp", *size, "--tmpfs", BOX_DIR, "--file", str(code_fd), f"{BOX_DIR}/main.py"]
    for d in interp.binds:  # after the tmpfs: an interpreter kept under /tmp stays visible
        argv += ["--ro-bind", d, d]
    argv += ["--remount-ro", "/", "--chdir", BOX_DIR, "--", *inner, interp.path, "-I", "-B", f"{BOX_DIR}/main.py"]
    return argv


def probe(launcher: tuple[str, ...], bwrap: str, interp: Interpreter, inner: tuple[str, ...] = ()) -> str | None:
    """None when a box runs here through ``launcher`` (the commands before bubblewrap: prlimit, setpriv) and
    ``inner`` (inside it; cached per launcher, binary, interpreter and inner), else the reason in one line."""
    key = (launcher, bwrap, interp.path, inner)
    with _lock:
        if key in _probes:
            return _probes[key]
    reason = _probe_once(launcher, bwrap, interp, inner)
    with _lock:
        _probes[key] = reason
    return reason


def _probe_once(launcher: tuple[str, ...], bwrap: str, interp: Interpreter, inner: tuple[str, ...]) -> str | None:
    found = shutil.which(bwrap, path=SAFE_PATH) if "/" not in bwrap else bwrap
    if found is None or not Path(found).is_file():
        return f"bubblewrap ({bwrap}) is not installed"
    read, write = os.pipe()
    try:
        os.write(write, b"print('box')\n")
        os.close(write)
        write = -1
        proc = subprocess.run([*launcher, *bwrap_argv(found, interp, read, inner)], env=box_env("/"),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, pass_fds=(read,))
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{found} did not run: {exc}"
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    if proc.returncode != 0 or proc.stdout.strip() != "box":
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        return f"{found} failed ({lines[-1] if lines else f'exit {proc.returncode}'})"
    return None


def unavailable(reason: str) -> SandboxUnavailable:
    """The one-line refusal: the reason, the fix, and the setting that runs code unboxed."""
    return SandboxUnavailable(
        f"the tool-code sandbox cannot start: {reason}; install bubblewrap (apt-get install bubblewrap) and allow "
        "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), or set "
        "rollout.tools.sandbox=none to run tool code unboxed (no isolation: only for code you trust)")
