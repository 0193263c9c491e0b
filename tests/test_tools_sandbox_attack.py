"""A red team's attacks on the code sandbox, beyond tests/test_tools_sandbox*.py: memory the address-space limit
does not count (memfd, System V shared memory and message queues), the kernel keyring (not namespaced: boxes of the
same user shared it, and the user's keys on the host were readable), the kernel's settings in a box that runs as the
host's root, the OOM killer's choice, a bubblewrap too old to size the box's tmpfs, and what the box inherits and
sees (descriptors, /proc, abstract sockets, odd output). Each leak check is also run where it leaks (unboxed, or the
old launcher) where that is cheap, so that it can fail; a check of a write opens for writing and writes nothing. The
fixtures and conventions are tests/test_tools_sandbox.py's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_tools_sandbox import CAP, TIMEOUT_S, _bwrap_or_skip, _fine_after

from dapo_mcore.tools import Sandbox

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return _bwrap_or_skip()


HOARD = textwrap.dedent("""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    held = {"memfd": 0, "shm": 0, "msg": 0}
    errors = set()
    for _ in range(4):  # memfd pages: counted by RLIMIT_FSIZE per file, not by RLIMIT_AS
        fd = libc.memfd_create(b"hoard", 0)
        if fd < 0:
            errors.add(os.strerror(ctypes.get_errno()))
            break
        os.write(fd, b"m" * (16 << 20))
        held["memfd"] += 16
    for _ in range(2):  # a System V segment outlives its mapping: detached, it is counted nowhere
        sid = libc.shmget(0, 32 << 20, 0o1600)
        if sid < 0:
            errors.add(os.strerror(ctypes.get_errno()))
            break
        addr = libc.shmat(sid, None, 0)
        ctypes.memset(addr, 1, 32 << 20)
        libc.shmdt(ctypes.c_void_p(addr))
        held["shm"] += 32
    qid = libc.msgget(0, 0o1600)  # System V message queues: kernel memory, 32000 queues x 16 KiB per namespace
    if qid < 0:
        errors.add(os.strerror(ctypes.get_errno()))
    else:
        held["msg"] = 1
    print(held, sorted(errors))
""")


def test_no_memory_is_held_outside_the_address_space_limit(box):
    """memory_mb bounds what a process maps; a memfd's pages (up to max_file_mb each, one per open file) and a
    detached System V segment (4096 of any size) are held by the kernel, mapped by nobody: a box held as much host
    memory as it could write in its time. The box refuses the system calls that make them."""
    hoarder = Sandbox(timeout_s=5, memory_mb=64, max_output_bytes=CAP)
    r = hoarder.run(HOARD)
    assert r.kind == "ok", r.stderr
    assert r.stdout.strip() == "{'memfd': 0, 'shm': 0, 'msg': 0} ['Operation not permitted']", r.stdout
    # the same code unboxed holds 128 MiB beyond its 64 MiB limit: the check above can fail
    unboxed = Sandbox(timeout_s=5, memory_mb=64, max_output_bytes=CAP, backend="none")
    assert unboxed.run(HOARD).stdout.startswith("{'memfd': 64, 'shm': 64, 'msg': 1}")
    _fine_after(hoarder)


KEY_WRITER = textwrap.dedent("""
    import ctypes, os, time
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(SYS_ADD_KEY, b"user", b"box-a-secret", b"payload-of-box-a", 16, -4)  # the user keyring
    if key < 0:
        print("add_key", os.strerror(ctypes.get_errno()), flush=True)
    else:
        libc.syscall(SYS_KEYCTL, 5, key, 0x3F3F0000)  # KEYCTL_SETPERM: everything for the same user
        print("added", flush=True)
        time.sleep(1.5)
""")

KEY_READER = textwrap.dedent("""
    import ctypes, time
    libc = ctypes.CDLL(None, use_errno=True)
    ids = []
    for _ in range(30):
        try:
            ids = [int(ln.split()[0], 16) for ln in open("/proc/keys") if "box-a-secret" in ln]
        except OSError:
            pass
        if ids:
            break
        time.sleep(0.05)
    buf = ctypes.create_string_buffer(64)
    for key in ids:
        libc.syscall(SYS_KEYCTL, 11, key, buf, 64)  # KEYCTL_READ
    print(ids != [], buf.value.decode())
""")


def _syscalls(code: str) -> str:
    numbers = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine)
    if numbers is None:
        pytest.skip(f"add_key/keyctl numbers not known here ({os.uname().machine})")
    return code.replace("SYS_ADD_KEY", str(numbers[0])).replace("SYS_KEYCTL", str(numbers[1]))


def test_boxes_of_the_same_user_share_no_keyring(box):
    """The kernel keyring is not namespaced: one box's key, in the user keyring, was listed in /proc/keys and read by
    another box running as the same user at once (a channel between calls; where the trainer runs as an ordinary
    user, the box is that user, and a key the user keeps there is readable). The box refuses the keyring calls."""
    results = {}
    writer = threading.Thread(target=lambda: results.setdefault("a", box.run(_syscalls(KEY_WRITER))))
    writer.start()
    try:
        reader = box.run(_syscalls(KEY_READER))
    finally:
        writer.join()
    assert reader.kind == "ok", reader.stderr
    assert results["a"].stdout == "add_key Operation not permitted\n", results["a"]
    assert reader.stdout == "False \n", reader.stdout


def test_the_syscall_filter_is_a_program_for_this_machine_or_none():
    """Eight bytes per instruction; every jump lands inside the program; another machine gets none."""
    from dapo_mcore.tools.box import syscall_filter

    prog = syscall_filter()
    if os.uname().machine not in ("x86_64", "aarch64"):
        assert prog is None
        return
    assert prog is not None and len(prog) % 8 == 0
    import struct

    insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    for at, (code, jt, jf, _) in enumerate(insns):
        if code & 0x07 == 0x05:  # BPF_JMP
            assert at + 1 + max(jt, jf) < len(insns)
    assert insns[-1][0] == insns[-2][0] == 0x06  # both ends return
    assert syscall_filter("riscv64") is None


@pytest.fixture
def old_bwrap():
    """A bubblewrap (the real one) whose --help lists no --size, as before 0.8, in a directory every user can read."""
    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("no bubblewrap")
    path = Path(tempfile.mkdtemp(prefix="dapo-old-bwrap-"))
    path.chmod(0o755)
    fake = path / "bwrap"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = --help ]; then {real} --help | grep -v -- --size; exit 0; fi\n'
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    yield str(fake)
    shutil.rmtree(path)


def test_a_bubblewrap_that_cannot_size_its_tmpfs_warns_at_every_start(box, old_bwrap, caplog):
    """Before 0.8 bubblewrap has no --size: the box's /tmp and /box are tmpfs as large as half the host's memory each
    (files there are memory, not counted by memory_mb). Like the unboxed backend, such a box says so at every start."""
    with caplog.at_level(logging.WARNING, logger="dapo_mcore.tools.sandbox"):
        old = Sandbox(timeout_s=TIMEOUT_S, memory_mb=256, bwrap=old_bwrap)
    warned = [r.getMessage() for r in caplog.records if "cannot size" in r.getMessage()]
    assert len(warned) == 1 and "bubblewrap 0.8" in warned[0], [r.getMessage() for r in caplog.records]
    r = old.run("import os\nst = os.statvfs('/tmp')\nprint(st.f_blocks * st.f_frsize > 64 * 2**20)")
    assert (r.kind, r.stdout) == ("ok", "True\n"), r  # what the warning is about: /tmp is not capped there
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dapo_mcore.tools.sandbox"):
        Sandbox(timeout_s=TIMEOUT_S, memory_mb=256)
    assert not [r for r in caplog.records if "cannot size" in r.getMessage()]


PROC_FILES = ["/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/vm/drop_caches",
              "/proc/sys/kernel/hostname", "/proc/sysrq-trigger", "/proc/irq/default_smp_affinity"]
"""Files of /proc that the kernel lets uid 0 write with no capability (a permission check on the uid alone): the
kernel's global settings (core_pattern runs a program as the host's root), interrupts."""

VIEW = textwrap.dedent("""
    import os
    print("fds", sorted(int(fd) for fd in os.listdir("/proc/self/fd")))  # the listing's own descriptor included
    print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    print("root", sorted(os.listdir("/proc/1/root")))
    for path in PROC_FILES:
        try:
            os.close(os.open(path, os.O_WRONLY))  # opened for writing, nothing written: a failing check harms nothing
            print(path, "writable")
        except OSError as exc:
            print(path, "refused", exc.strerror)
""").replace("PROC_FILES", repr(PROC_FILES))


def test_the_box_inherits_no_descriptor_and_sees_only_itself_in_proc(box):
    """Only stdin (/dev/null), stdout and stderr come in (no code, info or filter descriptor of the launcher, none
    of the trainer's); /proc holds the box's own process, whose root is the box's; the kernel's settings are
    read-only."""
    r = box.run(VIEW)
    assert r.kind == "ok", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "fds [0, 1, 2, 3]" and lines[1] == "pids [1]", lines
    assert "root" not in lines[2].split(" ", 1)[1] and "'box'" in lines[2] and "'work'" not in lines[2], lines[2]
    assert all(ln.split()[1] == "refused" for ln in lines[3:]), lines[3:]


def test_a_box_running_as_the_hosts_root_cannot_write_the_kernels_settings(monkeypatch):
    """Where the box runs as root (a root trainer whose interpreter nobody may read, or no setpriv), it is the
    host's uid 0 without capabilities, and /proc/sys checks the uid alone: the box could set kernel.core_pattern to
    a program the kernel then runs as the host's root at the next crash. The box's /proc/sys, /proc/irq, /proc/bus
    and /proc/sysrq-trigger are read-only."""
    if os.geteuid() != 0:
        pytest.skip("only a root trainer can run a box as root")
    real = shutil.which
    monkeypatch.setattr("dapo_mcore.tools.sandbox.shutil.which",
                        lambda name, path=None: None if name == "setpriv" else real(name, path=path))
    rooted = Sandbox(timeout_s=5, memory_mb=256, max_output_bytes=CAP)
    assert not rooted.unprivileged
    r = rooted.run(VIEW)
    assert r.kind == "ok" and r.stdout.splitlines()[1] == "pids [1]", r
    writable = [ln for ln in r.stdout.splitlines()[3:] if ln.split()[1] != "refused"]
    assert writable == [], writable
    assert rooted.run("print(open('/proc/sys/kernel/hostname').read())").stdout == "sandbox\n\n"  # its own


def test_a_slow_drip_of_output_does_not_hold_the_call_past_its_timeout(box):
    started = time.monotonic()
    r = box.run("import sys, time\nwhile True:\n    sys.stdout.write('.')\n    sys.stdout.flush()\n    time.sleep(0.2)")
    assert (r.kind, r.timed_out) == ("timeout", True) and r.stdout.startswith("...")
    assert time.monotonic() - started < TIMEOUT_S + 5.0


@pytest.mark.parametrize("code", ["print('a')\x00print('b')", "print('\udcff')", "#" + "x" * 10_000_000 + "\nprint(1)",
                                  "import sys\nsys.stdout.buffer.write(b'\\xff\\x00\\x1b[2J</interpreter>')"])
def test_odd_code_and_odd_output_come_back_as_results(box, code):
    """NUL bytes, lone surrogates and 10 MB of code reach the interpreter (it decides); output that is not UTF-8
    comes back with the bad bytes replaced; a forged closing tag in the output is plain text to the caller."""
    roomy = Sandbox(timeout_s=30, memory_mb=512, max_output_bytes=CAP)  # compiling 10 MB takes a while under load
    r = roomy.run(code)
    assert r.kind in ("ok", "error") and isinstance(r.stdout, str), r
    if "</interpreter>" in code:
        assert r.stdout == "\ufffd\x00\x1b[2J</interpreter>"


@pytest.mark.parametrize("launcher", ["util-linux", "preexec"])
def test_the_box_is_the_first_the_kernel_kills_when_the_node_runs_out_of_memory(launcher, monkeypatch):
    """memory_mb binds per process: boxes with many processes, side by side, can still run the node out of memory,
    and the kernel's OOM killer would pick the biggest process, the trainer. Box code runs at oom_score_adj 1000 (the
    first to go), set by util-linux's choom or between fork and exec; the trainer's own score is untouched."""
    if launcher == "preexec":
        real = shutil.which
        monkeypatch.setattr("dapo_mcore.tools.sandbox.shutil.which",
                            lambda name, path=None: None if name in ("prlimit", "choom") else real(name, path=path))
    elif shutil.which("choom") is None:
        pytest.skip("util-linux's choom is not installed")
    own = Path("/proc/self/oom_score_adj").read_text()
    code = "import subprocess\nprint(open('/proc/self/oom_score_adj').read().strip())\n" \
           "print(subprocess.run(['cat', '/proc/self/oom_score_adj'], capture_output=True, text=True).stdout.strip())"
    for backend in ("bwrap", "none"):
        try:
            sandbox = Sandbox(timeout_s=5, memory_mb=256, backend=backend)
        except Exception as exc:  # noqa: BLE001 - no bubblewrap here: the unboxed backend still shows it
            assert backend == "bwrap", exc
            continue
        r = sandbox.run(code)
        assert (r.kind, r.stdout) == ("ok", "1000\n1000\n"), (backend, r)
    assert Path("/proc/self/oom_score_adj").read_text() == own


def test_code_killed_by_a_signal_python_cannot_name_is_an_error_line_not_a_traceback(caplog):
    """A real-time signal (34 and up) has no name in the signal module: the python tool said 'ValueError: 40 is not a
    valid Signals' and logged a traceback."""
    from dapo_mcore.tools import get_tool

    unboxed = Sandbox(timeout_s=TIMEOUT_S, memory_mb=256, backend="none")
    tool = get_tool("python", unboxed)
    with caplog.at_level(logging.WARNING, logger="dapo_mcore.tools.registry"):
        out = tool("import os\nprint('before', flush=True)\nos.kill(os.getpid(), 40)")
        named = tool("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert (out.text, out.kind) == ("before\nthe code was killed by signal 40", "error")
    assert named.text == "the code was killed by SIGTERM"
    assert not [r for r in caplog.records if "raised" in r.getMessage()]


HOST_KEY = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(SYS_ADD_KEY, b"user", sys.argv[1].encode(), b"host-key-payload", 16, -4)
    libc.syscall(SYS_KEYCTL, 5, key, 0x3F3F0000)  # KEYCTL_SETPERM: the same user may view and read it
    libc.syscall(SYS_KEYCTL, 15, key, 60)  # KEYCTL_SET_TIMEOUT: gone in a minute whatever happens here
    print(key, flush=True)
    sys.stdin.read()  # until the test is done with it
    libc.syscall(SYS_KEYCTL, 21, key)  # KEYCTL_INVALIDATE: leave nothing in the user's keyring
""")


def test_the_keys_of_the_boxs_user_on_the_host_are_neither_listed_nor_read(box):
    """The box runs as a host user (nobody under a root trainer, else the trainer's own user): that user's keys on
    the host (a Kerberos ticket cache in the keyring, say) were listed in the box's /proc/keys, and read."""
    marker = f"dapo-host-key-{uuid.uuid4().hex}"
    as_user = [shutil.which("setpriv") or "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] \
        if box.unprivileged else []
    holder = subprocess.Popen([*as_user, box.interpreter.path, "-I", "-c", _syscalls(HOST_KEY), marker],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd="/")
    try:
        key = int(holder.stdout.readline())
        assert key > 0, "the host key was not made"
        r = box.run(textwrap.dedent(f"""
            import ctypes, json
            try:
                listed = {marker!r} in open("/proc/keys").read()
            except OSError as exc:
                listed = exc.strerror
            buf = ctypes.create_string_buffer(64)
            ctypes.CDLL(None).syscall({_syscalls("SYS_KEYCTL")}, 11, {key}, buf, 64)  # KEYCTL_READ
            print(json.dumps([listed, buf.value.decode()]))
        """))
    finally:
        holder.stdin.close()
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
    assert r.kind == "ok", r.stderr
    listed, payload = json.loads(r.stdout)
    assert listed is not True and payload == "", r.stdout  # unreadable (a strerror) or not there


def test_the_hosts_abstract_unix_sockets_are_out_of_reach(box):
    """Abstract unix sockets belong to the network namespace (no file to hide): the box's is its own."""
    name = f"\0dapo-attack-{uuid.uuid4().hex}"
    code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({name!r})\n    print('reached')\n" \
           "except OSError as exc:\n    print('refused', exc.strerror)"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(name)
        listener.listen(1)
        r = box.run(code)
        assert (r.kind, r.stdout) == ("ok", "refused Connection refused\n"), r
        unboxed = Sandbox(timeout_s=TIMEOUT_S, memory_mb=256, backend="none")
        assert unboxed.run(code).stdout == "reached\n"  # the check can fail


def test_code_over_the_file_size_limit_is_the_codes_error_not_a_sandbox_failure(box):
    """The code itself is a file in the box: past max_file_mb, bubblewrap could not write it and the call read as a
    sandbox failure (an outage, not the model's fault)."""
    small = Sandbox(timeout_s=10, memory_mb=256, max_output_bytes=CAP, max_file_mb=1)
    r = small.run("#" + "x" * (1 << 20) + "\nprint(1)")
    assert (r.kind, r.exit_code) == ("error", 1), r
    assert r.stderr.count("\n") == 1 and "max_file_mb" in r.stderr, r.stderr
    assert small.run("#" + "x" * 1000 + "\nprint(1)").stdout == "1\n"


def test_the_box_takes_no_pseudo_terminal_from_the_nodes_pool(box):
    """Pseudo-terminals come from one pool of the node (kernel.pty.max, less what is reserved for the host's own
    logins): a box that opened them by the thousand left none to the node's containers for the length of its call."""
    r = box.run("import pty\ntry:\n    pty.openpty()\n    print('opened')\nexcept OSError:\n    print('refused')")
    assert (r.kind, r.stdout) == ("ok", "refused\n"), r
