"""slurm/launch.sh's requeue and start-up contract, against stand-in `srun`/`scontrol` (plain bash, no Slurm).

The stand-ins behave as Slurm does where it matters here: `srun` runs the task command once per "node" (each node
with its own PATH and hostname) and reports the task's status, `scontrol requeue` is recorded. The real cluster path
(slurmstepd signalling every process of a step, --kill-on-bad-exit) is covered by tests/test_slurm_launch.py and
tests/test_slurm_multinode.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "slurm" / "launch.sh"

# `srun OPTIONS... COMMAND...`: the per-node check (its command is `bash -c ... dapo-check CMD`) runs once per node
# of FAKE_NODES with that node's bin dir first on PATH; the real step runs once, as task 0 of 1. USR1 (forwarded by
# launch.sh) is survived, as srun relays it instead of dying.
FAKE_SRUN = r"""#!/usr/bin/env bash
trap : USR1
printf '%s\n' "$@" >>"$FAKE_ROOT/srun_argv"
while [[ "$1" == --* ]]; do shift; done
if [[ " $* " == *" dapo-check "* ]]; then
    for node in $FAKE_NODES; do
        PATH="$FAKE_ROOT/$node:$FAKE_ROOT/bin:/usr/bin:/bin" "$@" || exit $?
    done
    exit 0
fi
echo started >>"$FAKE_ROOT/steps"
export SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 FAKE_LAUNCH_PID=$PPID
"$@" &
task=$!
while true; do
    wait "$task" && rc=0 || rc=$?
    kill -0 "$task" 2>/dev/null || break
done
exit "$rc"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1" in
    show) echo n1 ;;
    requeue) echo "requeue $2" >>"$FAKE_ROOT/requeues" ;;
esac
"""


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def fake_slurm(tmp_path):
    (tmp_path / "bin").mkdir()
    _exe(tmp_path / "bin" / "srun", FAKE_SRUN)
    _exe(tmp_path / "bin" / "scontrol", FAKE_SCONTROL)
    for node in ("n1", "n2"):
        (tmp_path / node).mkdir()
        _exe(tmp_path / node / "hostname", f"#!/bin/sh\necho {node}\n")
    return tmp_path


def launch(root: Path, *cmd: str, nodes: str = "n1", **env: str) -> subprocess.CompletedProcess:
    environ = {"PATH": f"{root / 'bin'}:/usr/bin:/bin", "FAKE_ROOT": str(root), "FAKE_NODES": nodes,
               "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "1",
               "SLURM_JOB_NUM_NODES": str(len(nodes.split())), **env}
    return subprocess.run([str(LAUNCH), *cmd], env=environ, capture_output=True, text=True, timeout=60)


def requeues(root: Path) -> list[str]:
    path = root / "requeues"
    return path.read_text().splitlines() if path.exists() else []


def test_the_requeue_exit_code_requeues(fake_slurm):
    proc = launch(fake_slurm, "bash", "-c", "exit 75")
    assert proc.returncode == 0, proc.stderr
    assert requeues(fake_slurm) == ["requeue 42"]
    assert "requeueing job 42 (restart 1)" in proc.stderr


@pytest.mark.parametrize("code", [1, 2, 137])
def test_a_failure_after_the_requeue_signal_is_not_requeued(fake_slurm, code):
    """USR1 asks for a requeue, but the step then crashed (1), refused its config (2) or was killed (137): the job
    ends with that code. (launch.sh used to requeue any non-zero exit once USR1 had arrived.)"""
    proc = launch(fake_slurm, "bash", "-c", f"kill -USR1 $FAKE_LAUNCH_PID; sleep 0.5; exit {code}")
    assert proc.returncode == code, proc.stderr
    assert requeues(fake_slurm) == []
    assert "got SIGUSR1: forwarding to srun" in proc.stderr
    assert f"the step failed with {code}, not 75: not requeueing" in proc.stderr


TERM_THE_STEP = "kill -TERM $PPID $(cut -d' ' -f4 /proc/$PPID/stat)"
"""slurmstepd's SIGTERM to the task's processes above the command: the wrapper's subshell that runs it ($PPID) and the
wrapper itself (its parent)."""


def test_the_task_wrapper_outlives_sigterm_and_reports_the_commands_code(fake_slurm):
    """srun --kill-on-bad-exit sends SIGTERM to every process of the step when the first rank exits 75: the wrapper
    shell must survive it and exit 75 with its command, or srun reports the signal (143) and nothing is requeued."""
    proc = launch(fake_slurm, "bash", "-c", f"{TERM_THE_STEP}; sleep 0.5; exit 75")
    assert "step exited with 75" in proc.stderr, proc.stderr
    assert proc.returncode == 0 and requeues(fake_slurm) == ["requeue 42"]


def test_a_node_without_the_command_stops_the_job_before_any_task_starts(fake_slurm):
    _exe(fake_slurm / "n1" / "dapo-mcore", "#!/bin/sh\nexit 0\n")  # installed on n1 only
    proc = launch(fake_slurm, "dapo-mcore", "train", "x.yaml", nodes="n1 n2")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "not on PATH" in line]
    assert len(lines) == 1 and "node(s) n2:" in lines[0] and "DAPO_VENV" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (fake_slurm / "steps").exists(), "no task may start"


def test_the_command_on_every_node_starts_the_step(fake_slurm):
    for node in ("n1", "n2"):
        _exe(fake_slurm / node / "dapo-mcore", "#!/bin/sh\nexit 0\n")
    proc = launch(fake_slurm, "dapo-mcore", nodes="n1 n2",
                  PATH=f"{fake_slurm / 'n1'}:{fake_slurm / 'bin'}:/usr/bin:/bin")
    assert proc.returncode == 0, proc.stderr
    assert (fake_slurm / "steps").read_text().split() == ["started"]


def test_usage_names_files_that_exist(fake_slurm):
    proc = launch(fake_slurm)
    assert proc.returncode == 2 and "usage: launch.sh COMMAND" in proc.stderr
    named = re.findall(r"examples/[\w.-]+\.yaml", proc.stderr + LAUNCH.read_text())
    assert named, "the usage shows an example config"
    assert all((REPO / path).is_file() for path in named), named


def test_launch_is_executable():
    assert os.access(LAUNCH, os.X_OK)


def test_a_requeue_exit_ignores_the_peers_sigterm_from_then_on():
    """The trainer's side of the contract: once it returns the requeue code, srun's SIGTERM (sent when the first
    rank exits) must not turn it into 143 during interpreter shutdown, which puts Python handlers back to default."""
    import signal

    from dapo_mcore.cli import _requeue_exit

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert _requeue_exit(1, 75) == 1
        assert all(signal.getsignal(sig) is handler for sig, handler in before.items())
        assert _requeue_exit(75, 75) == 75
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN and signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_the_cli_exit_code_survives_a_sigterm_during_shutdown():
    """Every rank refuses a bad config with exit 2; the first one's exit makes srun SIGTERM the others, maybe while
    their interpreter shuts down. The job must still end with 2, not 143 (seen on the two-node cluster)."""
    code = ("import atexit, os, signal, time\nimport dapo_mcore.cli as cli\ncli.main = lambda: 2\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))\ncli.entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])


def test_a_task_that_ignores_sigterm_is_killed_by_its_wrapper_and_does_not_outrank_the_requeue(fake_slurm):
    """A hung rank: srun's SIGTERM (sent when a peer exits 75 after its collective timed out) cannot end it. Its
    wrapper kills it after DAPO_TASK_KILL_GRACE seconds and exits 1, below the peers' 75: left to Slurm's SIGKILL
    (after KillWait) the task would die of a signal, which srun reports above every exit code (137: no requeue)."""
    proc = launch(fake_slurm, "bash", "-c", f"trap '' TERM; {TERM_THE_STEP}; exec sleep 60",
                  DAPO_TASK_KILL_GRACE="1")
    assert "step exited with 1" in proc.stderr, proc.stderr
    assert "rank 0 on " in proc.stderr and "did not exit within 1s of SIGTERM (hung?): killing it" in proc.stderr
    assert proc.returncode == 1 and requeues(fake_slurm) == []


def test_the_kill_grace_is_below_slurms_kill_wait(fake_slurm):
    """Default grace: KillWait (from `scontrol show config`) less 2 s, so the wrapper acts before Slurm's SIGKILL."""
    _exe(fake_slurm / "bin" / "scontrol", FAKE_SCONTROL.replace("show) echo n1 ;;", 'show) [[ "$2" == config ]] '
                                                                 '&& echo "KillWait                = 5 sec" || echo n1 ;;'))
    proc = launch(fake_slurm, "bash", "-c", "echo grace=$DAPO_TASK_KILL_GRACE >&2")
    assert proc.returncode == 0 and "grace=3" in proc.stderr, proc.stderr


def test_srun_args_keep_a_quoted_space_inside_one_argument(fake_slurm):
    _exe(fake_slurm / "n1" / "dapo-mcore", "#!/bin/sh\nexit 0\n")
    args = "--container-image=/shared/img.sqsh '--container-mounts=/shared/my data:/data' --no-container-mount-home"
    proc = launch(fake_slurm, "dapo-mcore", DAPO_SRUN_ARGS=args,
                  PATH=f"{fake_slurm / 'n1'}:{fake_slurm / 'bin'}:/usr/bin:/bin")
    assert proc.returncode == 0, proc.stderr
    argv = (fake_slurm / "srun_argv").read_text().splitlines()
    assert argv.count("--container-mounts=/shared/my data:/data") == 2  # the per-node check and the step
    assert argv.count("--container-image=/shared/img.sqsh") == 2 and "data:/data'" not in argv


def test_srun_args_with_an_unmatched_quote_stop_the_job_in_one_line(fake_slurm):
    proc = launch(fake_slurm, "dapo-mcore", DAPO_SRUN_ARGS="--container-mounts='/a:/b")
    assert proc.returncode == 2
    assert [ln for ln in proc.stderr.splitlines() if "unmatched quote" in ln] and "Traceback" not in proc.stderr
    assert not (fake_slurm / "steps").exists()
