"""The code sandbox against hostile code, as an attacker would write it: each attack is contained and the caller
goes on. Where an attack would leak through a weaker box, the same check is also run unboxed (``backend="none"``) and
must see the leak there: the check can fail. Attacks that could take the caller down (killing its parent, every
process, its group) run in a child process of their own session, and only once the code has seen it is pid 1 of a
pid namespace of its own (so a box without one attacks nothing). The box's processes (leftovers, reaping, the process
limit, killing the caller) are tests/test_tools_sandbox_processes.py's, with these fixtures and helpers.

Needs bubblewrap with user namespaces (``.ci/run`` installs it): without it these tests skip, and in CI they fail.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from dapo_mcore.tools import Sandbox, SandboxUnavailable, get_tool
from dapo_mcore.tools.box import SAFE_PATH, features

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 2.0
SLACK_S = 5.0  # the machine is shared; the point is that the call comes back, not how fast
CAP = 16 * 1024


def _bwrap_or_skip() -> Sandbox:
    try:
        return Sandbox(timeout_s=TIMEOUT_S, memory_mb=256, max_output_bytes=CAP)
    except SandboxUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs bubblewrap (.ci/run's apt step), yet: {exc}")
        pytest.skip(f"no bubblewrap sandbox here: {exc}")


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return _bwrap_or_skip()


@pytest.fixture(scope="module")
def unboxed() -> Sandbox:
    return Sandbox(timeout_s=TIMEOUT_S, memory_mb=256, max_output_bytes=CAP, backend="none")


def _fine_after(box: Sandbox) -> None:
    after = box.run("print(6 * 7)")
    assert (after.kind, after.stdout) == ("ok", "42\n")


def test_ordinary_code_runs_with_its_own_stdout_stderr_and_exit_code(box):
    r = box.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated, r.kind) == ("out\n", "err\n", 3, False, False,
                                                                                   "error")
    assert r.seconds > 0
    big = "x = " + repr("y" * 300_000) + "\nprint(len(x))"  # past the kernel's 128 KiB limit on one argument
    assert box.run(big).stdout == "300000\n"


@pytest.mark.parametrize("backend", ["bwrap", "none"])
def test_code_that_closes_its_output_still_gets_its_time_and_no_more(box, unboxed, backend):
    sandbox = box if backend == "bwrap" else unboxed
    r = sandbox.run("import os, sys\nos.close(1)\nos.close(2)\nwhile True:\n    pass")
    assert (r.kind, r.exit_code, r.timed_out) == ("timeout", None, True)
    assert TIMEOUT_S <= r.seconds < TIMEOUT_S + SLACK_S
    r = sandbox.run("import os, time\nprint('bye', flush=True)\nos.close(1)\nos.close(2)\ntime.sleep(0.3)\n"
                    "os._exit(3)")
    assert (r.kind, r.exit_code, r.stdout) == ("error", 3, "bye\n")


LIMITS = ("import resource as r\n"
          "print([r.getrlimit(getattr(r, 'RLIMIT_' + n)) for n in ('AS', 'CPU', 'FSIZE', 'NOFILE', 'CORE', 'NPROC')])")


@pytest.mark.parametrize("launcher", ["prlimit", "preexec"])
def test_the_code_runs_under_the_configured_rlimits(box, launcher, monkeypatch, request):
    """Set by util-linux's prlimit where it is installed, else between fork and exec: the same limits either way."""
    if launcher == "preexec":
        real = shutil.which
        monkeypatch.setattr("dapo_mcore.tools.sandbox.shutil.which",
                            lambda name, path=None: None if name == "prlimit" else real(name, path=path))
        # A trainer holds many descriptors: the child holds them too until exec, above the box's descriptor limit.
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(300)]
        request.addfinalizer(lambda: [os.close(fd) for fd in held])
    elif shutil.which("prlimit", path=SAFE_PATH) is None:
        pytest.skip("util-linux's prlimit is not installed")
    limited = Sandbox(timeout_s=2.5, memory_mb=300, max_output_bytes=CAP, max_file_mb=5, max_open_files=40,
                      max_processes=30)
    assert (limited._prefix[:1] == [shutil.which("prlimit", path=SAFE_PATH)]) == (launcher == "prlimit")
    want = [(300 * 2**20,) * 2, (4, 4), (5 * 2**20,) * 2, (40, 40), (0, 0)]
    unboxed = Sandbox(timeout_s=2.5, memory_mb=300, max_file_mb=5, max_open_files=40, max_processes=30,
                      backend="none")
    for sandbox in (limited, unboxed):
        r = sandbox.run(LIMITS)
        assert r.kind == "ok" and ast.literal_eval(r.stdout)[:5] == want, r
    # the process limit binds where the box runs unprivileged (a root trainer: as nobody)
    if limited.unprivileged:
        assert ast.literal_eval(limited.run(LIMITS).stdout)[5] == (30, 30)


def test_an_endless_loop_is_killed_at_the_timeout(box):
    r = box.run("while True:\n    pass")
    assert (r.kind, r.exit_code, r.timed_out) == ("timeout", None, True)
    assert TIMEOUT_S <= r.seconds < TIMEOUT_S + SLACK_S
    r = box.run("import time\nprint('before', flush=True)\ntime.sleep(3600)")
    assert (r.kind, r.stdout) == ("timeout", "before\n")
    _fine_after(box)


@pytest.mark.parametrize("bomb", ["x = bytearray(4 * 1024 ** 3)",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))"])
def test_a_memory_bomb_fails_at_the_address_space_limit(box, bomb):
    r = box.run(bomb)
    assert r.kind == "error" and r.stderr.strip().endswith("MemoryError")
    _fine_after(box)


@pytest.mark.parametrize("flood", ["while True:\n    print('x' * 4096)",
                                   "import sys\nwhile True:\n    sys.stderr.write('e' * 65536)",
                                   "import sys\nsys.stdout.write('y' * 50_000_000)"])
def test_an_output_flood_is_cut_at_the_cap_and_stopped(box, flood):
    r = box.run(flood)
    assert (r.kind, r.truncated, r.timed_out) == ("truncated", True, False)
    assert len(r.stdout.encode()) + len(r.stderr.encode()) == CAP
    _fine_after(box)


FILL = textwrap.dedent("""
    for d in ["/tmp", "/box", "/dev/shm", "/dev", "/", "/usr"]:
        n = 0
        try:
            for i in range(20):
                with open(f"{d}/fill{i}", "wb") as f:
                    f.write(b"z" * 8 * 2**20)
                n += 1
        except OSError as exc:
            print(d, n, exc.strerror)
        else:
            print(d, n, "filled")
    open("/dev/null", "w").write("device nodes still work")
""")


def test_a_disk_filler_hits_the_box_limits_not_the_hosts_memory(box):
    """The box's writable places are memory (tmpfs): each is capped (64 MiB), the rest is read-only."""
    r = box.run(FILL)
    assert r.kind == "ok", r.stderr
    seen = {ln.split(" ", 1)[0]: ln.split(" ", 2)[1:] for ln in r.stdout.splitlines()}
    for d in ("/tmp", "/box", "/dev/shm"):
        assert int(seen[d][0]) <= 8 and seen[d][1] == "No space left on device", (d, seen[d])
    for d in ("/dev", "/", "/usr"):
        assert seen[d] == ["0", "Read-only file system"], (d, seen[d])
    r = box.run("open('big', 'wb').write(b'z' * 40 * 1024 ** 2)")  # one file past max_file_mb
    assert r.kind == "error" and r.stderr.strip().endswith("OSError: [Errno 27] File too large"), r


def _connect_code(port: int) -> str:
    return textwrap.dedent(f"""
        import socket
        for what, attempt in [
                ("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1)),
                ("dns", lambda: socket.getaddrinfo("pypi.org", 443)),
                ("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("1.1.1.1", 53)))]:
            try:
                attempt()
                print(what, "reached")
            except OSError as exc:
                print(what, "failed", type(exc).__name__)
    """)


def test_no_network_the_hosts_listener_sees_no_connection(box, unboxed):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        r = box.run(_connect_code(port))
        assert r.kind == "ok", r.stderr
        assert [ln.split()[:2] for ln in r.stdout.splitlines()] == [["tcp", "failed"], ["dns", "failed"],
                                                                    ["udp", "failed"]]
        with pytest.raises(TimeoutError):
            listener.accept()
        # unboxed, the same code reaches the listener: the check above can fail
        r = unboxed.run(_connect_code(port))
        assert r.stdout.startswith("tcp reached")
        conn, _ = listener.accept()
        conn.close()


def test_nothing_of_the_host_is_readable_or_writable_outside_the_box(box, unboxed, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-of-the-host")
    host_tmp = Path(f"/tmp/dapo-box-wrote-{uuid.uuid4().hex}")
    probe = textwrap.dedent(f"""
        import os
        for path in ["/root", "/work", "/home", {str(ROOT)!r}, {str(tmp_path)!r}]:
            try:
                print(path, "listed", os.listdir(path))
            except OSError as exc:
                print(path, "hidden", type(exc).__name__)
        for path in [{str(secret)!r}, "/etc/shadow", "/etc/passwd", {str(ROOT / "pyproject.toml")!r}]:
            try:
                print(path, "read", open(path).read()[:40])
            except OSError as exc:
                print(path, "hidden", type(exc).__name__)
        for path in [{str(host_tmp)!r}, {str(ROOT / "written-by-the-box")!r}, "/usr/written-by-the-box"]:
            try:
                open(path, "w").write("x")
                print(path, "written")
            except OSError as exc:
                print(path, "refused", type(exc).__name__)
    """)
    r = box.run(probe)
    assert r.kind == "ok", r.stderr
    seen = dict(ln.split(" ", 1) for ln in r.stdout.splitlines())
    for path in ["/root", "/work", "/home", str(ROOT), str(tmp_path), str(secret), "/etc/shadow", "/etc/passwd",
                 str(ROOT / "pyproject.toml")]:
        assert seen[path].startswith("hidden"), (path, seen[path])
    assert seen[str(host_tmp)] == "written"  # into the box's own /tmp ...
    assert not host_tmp.exists()  # ... which is not the host's
    assert seen[str(ROOT / "written-by-the-box")].startswith("refused")
    assert seen["/usr/written-by-the-box"].startswith("refused")
    assert not (ROOT / "written-by-the-box").exists()
    # unboxed, the same probe reads the secret and writes the host's /tmp: the checks above can fail
    r = unboxed.run(probe.replace(str(ROOT / "written-by-the-box"), str(tmp_path / "unboxed-wrote")))
    try:
        assert f"{secret} read the-secret-of-the-host" in r.stdout and host_tmp.exists()
    finally:
        host_tmp.unlink(missing_ok=True)


SNOOP = textwrap.dedent("""
    import os
    key = "SECRET_API_KEY"
    found = [f"os.environ[{k}]" for k, v in os.environ.items() if k == key or "sk-test-" in v]
    read = 0
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        for part in ("environ", "cmdline"):
            try:
                data = open(f"/proc/{pid}/{part}", "rb").read()
            except OSError:
                continue
            read += part == "environ"
            if key.encode() in data or b"sk-test-" in data:
                found.append(f"/proc/{pid}/{part}")
    print(read, found)
""")

HARNESS = textwrap.dedent("""
    import json, os, sys
    from dapo_mcore.tools import Sandbox
    box = Sandbox(timeout_s=3, memory_mb=256, backend=sys.argv[2])
    r = box.run(sys.argv[1].replace("HOST_PID", str(os.getpid())))
    after = box.run("print('still here')")
    print(json.dumps({"kind": r.kind, "stdout": r.stdout, "stderr": r.stderr[-400:], "after": after.stdout}))
""")


def _in_child(code: str, backend: str = "bwrap", stdin: int = subprocess.DEVNULL, **env: str) -> dict:
    """Run `code` through a Sandbox in a child process of its own session (the caller an attack aims at); its
    result and a call after it."""
    child_env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    proc = subprocess.run([sys.executable, "-c", HARNESS, code, backend], env=child_env, cwd=ROOT, timeout=120,
                          stdin=stdin, capture_output=True, text=True, start_new_session=True)
    assert proc.returncode == 0, f"the caller died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_trainers_environment_is_not_visible_in_the_box(box):
    secret = f"sk-test-{uuid.uuid4().hex}"
    out = _in_child(SNOOP, SECRET_API_KEY=secret)
    read, found = out["stdout"].split(" ", 1)
    assert found.strip() == "[]"
    assert int(read) >= 1  # the box's own processes (the launcher is outside its pid namespace): the scan read them
    # unboxed, the trainer's /proc is readable: the scan finds the key there, so the check above can fail
    out = _in_child(SNOOP, backend="none", SECRET_API_KEY=secret)
    assert "/environ" in out["stdout"].split(" ", 1)[1]


def test_the_box_cannot_make_namespaces_or_gain_privileges(box):
    """No capability in the box; no network or mount namespace of its own (they need one), and no user namespace
    (where bubblewrap can forbid them: 0.8+), the usual first step of a kernel exploit."""
    r = box.run(textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(open("/proc/self/status").read().split("CapEff:")[1].split()[0])
        for name, flag in [("user", 0x10000000), ("net", 0x40000000), ("mount", 0x00020000)]:
            print(name, libc.unshare(flag), os.strerror(ctypes.get_errno()))
    """))
    lines = r.stdout.splitlines()
    assert lines[0] == "0000000000000000", r
    assert lines[2].startswith("net -1") and lines[3].startswith("mount -1"), r.stdout
    if "--disable-userns" in features(box._bwrap):
        assert lines[1].startswith("user -1"), r.stdout


def test_parallel_calls_from_threads_get_their_own_results(box):
    results: dict[int, object] = {}

    def call(i: int) -> None:
        results[i] = box.run(f"import time, sys\ntime.sleep(0.05 * ({i} % 3))\nprint({i})\nprint('e{i}', file=sys.stderr)"
                             f"\nsys.exit({i})")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: (r.stdout, r.stderr, r.exit_code) for i, r in results.items()} == {
        i: (f"{i}\n", f"e{i}\n", i) for i in range(8)}


def test_stdin_is_closed(box):
    """The caller's stdin is a pipe nobody writes to (a read of it would hang): the code reads end-of-file at once."""
    read, write = os.pipe()
    try:
        out = _in_child("import sys\nprint(repr(sys.stdin.read()))\ninput()", stdin=read)
    finally:
        os.close(read)
        os.close(write)
    assert out["kind"] == "error" and out["stdout"] == "''\n", out
    assert out["stderr"].strip().endswith("EOFError: EOF when reading a line")


def test_the_python_tool_runs_a_fenced_block_in_the_box(box):
    tool = get_tool("python", box)
    out = tool("```python\nimport math\nprint(math.comb(40, 20))\n```")
    assert (out.text, out.kind) == (f"{137846528820}\n", "ok")
    out = tool("print('partial')\nraise ValueError('bad input')")
    assert (out.text, out.kind, out.errored) == ("partial\nValueError: bad input", "error", True)


def test_where_bubblewrap_cannot_run_the_refusal_is_one_line_naming_the_unboxed_setting(tmp_path, capsys):
    with pytest.raises(SandboxUnavailable) as missing:
        Sandbox(bwrap=str(tmp_path / "no-bwrap"))
    fake = tmp_path / "bwrap"  # fails as bubblewrap does where user namespaces are off
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel "
                    "does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as no_userns:
        Sandbox(bwrap=str(fake))
    for exc, why in [(missing, "is not installed"), (no_userns, "No permissions to creating new namespace")]:
        line = str(exc.value)
        assert "\n" not in line and why in line and "rollout.tools.sandbox=none" in line
    # through the CLI's guard: one line on stderr, exit 2, no traceback
    from dapo_mcore.cli import _guard
    from dapo_mcore.errors import EXIT_USAGE

    assert _guard(lambda: Sandbox(bwrap=str(fake)) and 0) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollout.tools.sandbox=none" in err and "Traceback" not in err


@pytest.fixture
def world_readable_dir():
    """A directory every user can read (the launcher may run as nobody): pytest's tmp_path is root's alone."""
    path = Path(tempfile.mkdtemp(prefix="dapo-box-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_an_interpreter_that_cannot_serve_is_refused_in_one_line_naming_the_setting(tmp_path, monkeypatch):
    with pytest.raises(SandboxUnavailable, match="rollout.tools.python") as missing:
        Sandbox(python="python3.0-not-here")
    home = tmp_path / "home"  # an interpreter installed with its prefix at a home directory the run works in
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True)
    (home / "project").mkdir()
    monkeypatch.chdir(home / "project")
    with pytest.raises(SandboxUnavailable, match="holds the working directory") as exposing:
        Sandbox(python=str(home / "bin" / "python"), backend="none")
    needs_env = tmp_path / "module-python"  # a cluster module's Python: libraries found through LD_LIBRARY_PATH only
    needs_env.write_text("#!/bin/sh\necho 'python3: error while loading shared libraries: libpython3.12.so.1.0: "
                         "cannot open shared object file' >&2\nexit 127\n")
    needs_env.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="empty environment .python3: error while loading") as loader:
        Sandbox(python=str(needs_env))
    for exc in (missing, exposing, loader):
        assert "\n" not in str(exc.value) and "rollout.tools.python" in str(exc.value)


def test_a_box_that_fails_to_start_at_a_call_is_a_result_not_a_crash(box, world_readable_dir):
    broken = Sandbox(timeout_s=TIMEOUT_S, memory_mb=256)
    fake = world_readable_dir / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: No space left on device' >&2\nexit 1\n")
    fake.chmod(0o755)
    broken._bwrap = str(fake)  # the probe passed at start; later the kernel runs out of namespaces
    r = broken.run("print(1)")
    assert (r.kind, r.exit_code) == ("sandbox_failure", 1) and "Creating new namespace failed" in r.stderr
    broken._bwrap = str(world_readable_dir / "removed")  # the binary vanished
    r = broken.run("print(1)")
    assert r.kind == "sandbox_failure" and "No such file" in r.stderr, r
    out = get_tool("python", broken)("print(1)")
    assert out.kind == "sandbox_failure" and out.errored


def test_the_unboxed_backend_warns_at_every_start(caplog):
    with caplog.at_level(logging.WARNING, logger="dapo_mcore.tools.sandbox"):
        Sandbox(backend="none")
        Sandbox(backend="none")
    warnings = [r.getMessage() for r in caplog.records if "UNBOXED" in r.getMessage()]
    assert len(warnings) == 2 and "rollout.tools.sandbox=none" in warnings[0]
    assert Sandbox(backend="none").run("print(1)").kind == "ok"
