"""How a launched run ends: its ranks die with the launcher (even a kill -9 of it), a rank that dies is named at once
and the others stopped, SIGHUP asks for a checkpoint as SIGTERM does, a stop signal during start-up is one line and
the requeue code, and a signal in the last step of a finished run exits 0 (a scheduler requeues nothing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dapo_mcore.commands import launcher
from dapo_mcore.trainer import EXIT_REQUEUE, _Signals

# each test carries its own tier marker: a module-level unit mark would put the
# distributed/e2e tests below into the quick unit subset too (pytest adds it to every test of the module)

ROOT = Path(__file__).resolve().parents[1]
_RANK = "import time; from dapo_mcore.commands.launcher import bind_to_launcher; bind_to_launcher(); print('up', flush=True); time.sleep(60)"
_LAUNCHER = f"""import os, subprocess, sys
os.environ[{launcher.LAUNCHER_PID_ENV!r}] = str(os.getpid())
child = subprocess.Popen([sys.executable, "-c", {_RANK!r}], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "up\\n"
print(child.pid, flush=True)
child.wait()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.unit
def test_a_rank_dies_with_its_launcher_even_on_kill_9():
    boss = subprocess.Popen([sys.executable, "-c", _LAUNCHER], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        rank = int(boss.stdout.readline())
        boss.kill()  # SIGKILL: no handler of the launcher runs
        boss.wait(timeout=30)
        assert _gone(rank), "the rank outlived its launcher"
    finally:
        boss.kill()


@pytest.mark.unit
def test_a_rank_whose_launcher_is_already_gone_exits_at_once():
    env = {**_env(), launcher.LAUNCHER_PID_ENV: "1"}  # not this process's parent: the launcher died before the bind
    proc = subprocess.run([sys.executable, "-c", _RANK], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 137 and "up" not in proc.stdout


@pytest.mark.unit
def test_a_dead_rank_is_named_at_once_and_the_others_stopped(capsys):
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**_env(), "RANK": str(r)},
                              start_new_session=True) for r in range(3)]
    try:
        watch = launcher.RankWatch("train")
        assert watch.check() is None  # all alive: nothing to say
        ranks[1].kill()
        deadline = time.monotonic() + 10
        while watch.check() is None:
            assert time.monotonic() < deadline, "the dead rank was not seen"
            time.sleep(0.05)
        assert watch.code == 137
        for r in (0, 2):
            assert ranks[r].wait(timeout=10) == -signal.SIGKILL  # stopped, not asked to checkpoint
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dapo-mcore: rank 1 died of SIGKILL (exit 137)"), err
        assert "resumes the run from its last checkpoint" in err[0] and "will checkpoint" not in err[0]
    finally:
        for p in ranks:
            p.kill()
            p.wait()


@pytest.mark.unit
def test_the_rank_that_died_first_is_named_when_torch_already_sigtermed_its_peer(capsys):
    """Torch's agent saw rank 1's SIGKILL first and sent rank 0 SIGTERM before the watch looked: both are dead at
    that look, rank 0 first among the children; the line names rank 1 (a loaded machine named rank 0, exit 143)."""
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**_env(), "RANK": str(r)},
                              start_new_session=True) for r in range(2)]
    try:
        watch = launcher.RankWatch("train")
        assert watch.check() is None  # it has seen them alive (a zombie's environment cannot be read)
        ranks[1].kill()
        ranks[0].terminate()
        deadline = time.monotonic() + 10
        while not all(launcher._killed_by(p.pid) for p in ranks):  # both zombies, not reaped
            assert time.monotonic() < deadline, "the ranks did not die"
            time.sleep(0.05)
        assert watch.check() == 137
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dapo-mcore: rank 1 died of SIGKILL (exit 137)"), err
    finally:
        for p in ranks:
            p.kill()
            p.wait()


@pytest.mark.unit
def test_sighup_is_forwarded_and_asks_for_a_checkpoint_and_requeue():
    assert signal.SIGHUP in launcher.FORWARDED
    signals = _Signals()
    try:
        signals._handle(signal.SIGHUP, None)
        assert signals.requested == "SIGHUP" and signals.exit_code == EXIT_REQUEUE
    finally:
        signals.restore()


@pytest.mark.unit
def test_a_stop_during_the_last_step_exits_0_and_ignores_later_signals():
    before = signal.getsignal(signal.SIGTERM)
    signals = _Signals()
    try:
        signals._handle(signal.SIGTERM, None)
        assert signals.stop_exit(4, 5) == EXIT_REQUEUE  # a step before the last: checkpoint, requeue
        assert signals.stop_exit(5, 5) == 0  # the run is finished: nothing to requeue
    finally:
        signals.restore()
    try:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # a second scancel cannot turn 0 into 143
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.unit
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_during_start_up_is_one_line_and_the_requeue_code(sig):
    code = ("import sys, time; from dapo_mcore.signals import startup; "
            "startup.arm(lambda line: print(line, file=sys.stderr)); print('armed', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**_env(), "RANK": "0"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "armed\n"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_REQUEUE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dapo-mcore: {sig.name} during start-up"), lines
    assert f"(sent by pid {os.getpid()}: " in lines[0], lines  # who stopped it: here, this test's process


@pytest.mark.distributed
def test_a_rank_killed_under_the_launcher_is_named_at_once(cli_env, tmp_path):
    """A real launch: kill -9 of rank 1 during step 2 -> one line naming it, exit 137, no false checkpoint promise."""
    proc = subprocess.Popen([sys.executable, "-m", "dapo_mcore.cli", "train", "--nproc-per-node", "2",
                             str(ROOT / "examples" / "tiny_cpu.yaml"), f"run.dir={tmp_path / 'run'}", "train.steps=40",
                             "eval.every=0", "eval.at_start=false", "checkpoint.every=0",
                             "telemetry.progress_every_s=0.001"], env=cli_env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "step 1/40" in line:
                [rank1] = [c for c in psutil.Process(proc.pid).children() if c.environ().get("RANK") == "1"]
                rank1.kill()
                break
        out = "".join(seen) + proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode == 137, out[-3000:]
    assert out.count("dapo-mcore: rank 1 died of SIGKILL (exit 137)") == 1, out[-3000:]
    assert "will checkpoint" not in out and "Traceback" not in out and "another rank of the job" not in out, out[-3000:]


@pytest.mark.unit
def test_the_stop_line_names_who_sent_the_signal():
    from dapo_mcore.signals.startup import sender

    def info(code, pid):  # struct_siginfo: si_signo, si_code, si_errno, si_pid, si_uid, si_status, si_band
        return signal.struct_siginfo((signal.SIGHUP, code, 0, pid, 0, 0, 0))

    own = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert sender(info(0, os.getpid())) == f" (sent by pid {os.getpid()}: {own})"  # kill(2)
    assert sender(info(-6, os.getpid())) == f" (sent by pid {os.getpid()}: {own})"  # tgkill(2)
    assert sender(info(0x80, 0)) == " (sent by the kernel)"  # SI_KERNEL: a terminal's hang-up
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert sender(info(0, gone.pid)) == f" (sent by pid {gone.pid})"  # already gone: its pid alone
