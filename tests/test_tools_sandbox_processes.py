"""The code sandbox's processes: none outlives its call (exits, timeouts, a killed caller), each is reaped by the
call, a fork bomb stops at the box's process limit, and killing the caller from inside fails. The hostile-code
conventions (and the fixtures) are tests/test_tools_sandbox.py's: attacks that could take the caller down run in a
child process of their own session, and only once the code has seen it is pid 1 of a pid namespace of its own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_tools_sandbox import CAP, ROOT, TIMEOUT_S, _bwrap_or_skip, _fine_after, _in_child

from dapo_mcore.tools import Sandbox

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return _bwrap_or_skip()


@pytest.fixture(scope="module")
def unboxed() -> Sandbox:
    return Sandbox(timeout_s=TIMEOUT_S, memory_mb=256, max_output_bytes=CAP, backend="none")

def _leftovers(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # the process exited while we looked
    return found


def _spawner(marker: str) -> str:
    """Code that leaves 30 sleepers behind (forked, double-forked into their own session, and a Popen), named
    `marker` in their command line, then exits at once."""
    return textwrap.dedent(f"""
        import os, subprocess, sys
        sleep = [p for p in ("/usr/bin/sleep", "/bin/sleep") if os.path.exists(p)][0]
        for i in range(28):
            if os.fork() == 0:
                if i % 2 and os.fork() != 0:
                    os._exit(0)
                os.setsid()
                os.execv(sleep, ["{marker}", "60"])
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {marker}"], start_new_session=True)
        os.execv(sleep, ["{marker}", "0.2"])
    """)


def _gone(marker: str, within_s: float = 3.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := _leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_no_process_of_the_box_outlives_the_call(box, unboxed):
    marker = f"dapo-box-leftover-{uuid.uuid4().hex}"
    r = box.run(_spawner(marker))
    assert r.kind == "ok", r.stderr
    assert _gone(marker) == []
    # the check sees leftovers where there are some: unboxed, the children in sessions of their own survive
    marker = f"dapo-unboxed-leftover-{uuid.uuid4().hex}"
    r = unboxed.run(_spawner(marker))
    escaped = _leftovers(marker)
    for pid in escaped:
        os.kill(pid, signal.SIGKILL)
    assert r.kind == "ok" and len(escaped) >= 10


FORKS = textwrap.dedent("""
    import os, time
    n = 0
    try:
        for i in range(200):
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            n += 1
    except OSError as exc:
        print(n, exc.strerror)
    else:
        print(n, "all forked")
""")


def test_a_fork_bomb_stops_at_the_process_limit(box):
    """Where the trainer is root the box runs as nobody, under max_processes (root ignores the limit): a fork
    loop stops there (run bounded: 200 forks at most)."""
    if not box.unprivileged:
        pytest.skip("the process limit binds where the trainer runs as root (the box then runs as nobody)")
    limited = Sandbox(timeout_s=TIMEOUT_S, memory_mb=256, max_processes=24)
    r = limited.run(FORKS)
    n, why = r.stdout.split(" ", 1)
    assert int(n) < 24 and why.strip() == "Resource temporarily unavailable", r
    _fine_after(limited)


def test_the_process_limit_is_per_box_not_shared_by_boxes_running_at_once(box):
    """The limit counts one box's processes: 16 boxes at once, each near its limit of 8, all run."""
    if not box.unprivileged:
        pytest.skip("the process limit binds where the trainer runs as root (the box then runs as nobody)")
    limited = Sandbox(timeout_s=10, memory_mb=256, max_processes=8)
    code = ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        time.sleep(1)\n        os._exit(0)\n"
            "print('ok')")  # 7 processes with the launcher's two
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: limited.run(code), range(16)))
    assert [(r.kind, r.stdout) for r in results] == [("ok", "ok\n")] * 16, [r for r in results if r.kind != "ok"][:2]


def test_as_root_a_box_nobody_can_run_falls_back_to_root_with_a_warning(box, caplog):
    """An interpreter only root may read (a venv in root's own directory): the box runs as root, and says so."""
    if not box.unprivileged:
        pytest.skip("only where the trainer runs as root")
    private = Path(tempfile.mkdtemp(prefix="dapo-box-root-only-"))  # 0700
    try:
        subprocess.run([box.interpreter.path, "-m", "venv", "--without-pip", str(private / "env")], check=True)
        with caplog.at_level(logging.WARNING, logger="dapo_mcore.tools.sandbox"):
            rooted = Sandbox(timeout_s=TIMEOUT_S, python=str(private / "env" / "bin" / "python"))
        assert not rooted.unprivileged
        assert any("runs as root, not as nobody" in r.getMessage() for r in caplog.records)
        assert rooted.run("import sys; print(sys.prefix)").stdout == f"{private / 'env'}\n"
    finally:
        shutil.rmtree(private)


REAPER = textwrap.dedent("""
    import ctypes, json, os, sys, time
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of this process's children come here
    from dapo_mcore.tools import Sandbox
    box = Sandbox(timeout_s=1.5, memory_mb=256, max_output_bytes=4096)
    codes = ["print(1)", "1 / 0", "while True:\\n    pass", "while True:\\n    print('x' * 999)",
             "import os, time\\nfor _ in range(3):\\n    if os.fork() == 0:\\n        time.sleep(30)\\nprint(2)"]
    kinds = [box.run(code).kind for code in codes]
    time.sleep(0.5)
    orphans = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        orphans += 1
    print(json.dumps({"kinds": kinds, "orphans": orphans}))
""")


def test_no_call_leaves_a_process_for_the_hosts_init_to_reap(box):
    """A trainer that is a container's pid 1 reaps nothing it did not start itself: every process of a call must be
    reaped by the call, whatever its end (a subreaper stands in for such a pid 1 and counts what comes to it)."""
    proc = subprocess.run([sys.executable, "-c", REAPER], env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                          capture_output=True, text=True, timeout=120, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["kinds"] == ["ok", "error", "timeout", "truncated", "ok"]
    assert out["orphans"] == 0


def test_a_trainer_killed_during_a_call_leaves_no_box_behind(box):
    """kill -9 of the caller while its box runs (with children of its own): the whole box dies with it."""
    marker = f"dapo-box-orphaned-{uuid.uuid4().hex}"
    code = _spawner(marker).replace('"0.2"', '"60"')
    caller = subprocess.Popen([sys.executable, "-c", "import sys\nfrom dapo_mcore.tools import Sandbox\n"
                               "Sandbox(timeout_s=60).run(sys.argv[1])", code],
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(_leftovers(marker)) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_leftovers(marker)) >= 20, "the box did not start its children"
    finally:
        caller.kill()
        caller.wait()
    left = _gone(marker)
    for pid in left:  # a failing box must not leave them running
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_a_timed_out_box_leaves_nothing_behind(box):
    marker = f"dapo-box-hung-{uuid.uuid4().hex}"
    r = box.run(_spawner(marker).replace('"0.2"', '"60"'))
    assert r.kind == "timeout"
    assert _gone(marker) == []



NAMESPACED = "import os, signal\nif os.getpid() != 1:\n    raise SystemExit('not in a pid namespace: no attack')\n" \
             "print('attacking', flush=True)\n"


@pytest.mark.parametrize("attack", ["os.kill(os.getppid(), signal.SIGKILL)", "os.kill(-1, signal.SIGKILL)",
                                    "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
                                    "os.killpg(0, signal.SIGKILL)", "os.kill(HOST_PID, signal.SIGKILL)"])
def test_killing_the_caller_fails_and_the_caller_goes_on(box, attack):
    out = _in_child(NAMESPACED + attack + "\nimport time; time.sleep(0.2)\nprint('done')")
    assert out["stdout"].startswith("attacking"), out
    assert out["after"] == "still here\n"


