"""slurm/launch.sh's per-task wrapper reports its command's exit code even when SIGTERM and the command's exit
arrive together (slurmstepd signals every process of the step; the trainer exits 75 to be requeued), and kills a
command that outlives the grace after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
LAUNCH = Path(__file__).resolve().parents[1] / "slurm" / "launch.sh"


def task_wrapper() -> str:
    text = LAUNCH.read_text()
    start = text.index("<<'WRAPPER' || true\n") + len("<<'WRAPPER' || true\n")
    return text[start:text.index("\nWRAPPER\n", start)]


def _start(command: str, grace: int = 30, new_session: bool = False) -> subprocess.Popen:
    env = {**os.environ, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
           "DAPO_TASK_KILL_GRACE": str(grace)}
    return subprocess.Popen(["bash", "-c", task_wrapper(), "dapo-task", "bash", "-c", command], env=env,
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)


def test_sigterm_with_the_commands_exit_keeps_its_code():
    """slurmstepd's SIGTERM reaches every process of the step while the trainer exits 75: 40 tries, each a command
    that signals its whole process group (the wrapper included) and exits at once. The old wrapper lost the code in
    1-9 of 40 (load 2-20; a race, so on a quiet machine it can pass by luck); the status file leaves no window."""
    codes = []
    for _ in range(40):
        proc = _start("trap '' TERM; kill -TERM 0; exit 75", new_session=True)
        codes.append(proc.wait(timeout=60))
    assert codes == [75] * 40, codes


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace():
    proc = _start("trap '' TERM; echo $$ >&2; exec sleep 120", grace=1)
    pid = int(proc.stderr.readline())
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 1
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), f"the hung command is still running ({state})"  # a zombie until init reaps it
