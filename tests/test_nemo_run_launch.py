"""NeMo-Run launcher (examples/nemo_run/launch.py): the SlurmExecutor's 32B sbatch (dry run), LocalExecutor running
real jobs, and SlurmExecutor jobs on a real local Slurm (requeue on exit 75 only, logs in the run directory).

Every launch runs with this interpreter's venv NOT on PATH (not activated), as a user runs ``.venv/bin/python
examples/nemo_run/launch.py``. Runs in CI's nemo-run tier (.ci/tiers/30-nemo-run.sh), which fails on any skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A per-test mark, not a module-level skip: a module-level skip is reported even where a tier's ``-m`` deselects every
# test here, and the tiers that fail on any skip (DAPO_MCORE_CI_NO_SKIPS=1) would fail on it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("nemo_run") is None,
                                reason="needs nemo-run: pip install nemo-run==0.11.1 leptonai==0.27.3")

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "examples" / "nemo_run" / "launch.py"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# One CPU task per rank on the local node: no GPUs, no accounting.
SLURM_CPU = ["--nodes", "1", "--gpus-per-node", "0", "--cpus-per-task", "1", "--time", "00:30:00",
             "--signal-seconds", "60"]


def launch(tmp_path: Path, *args: str, timeout: int = 300, env: dict[str, str] | None = None,
           cache: str | None = None) -> subprocess.CompletedProcess:
    """``python launch.py ARGS`` with this interpreter's bin directory off PATH (the venv is not activated)."""
    full = dict(env if env is not None else os.environ, NEMORUN_HOME=str(tmp_path / "nemorun_home"),
                PYTHONPATH=str(REPO))
    venv_bin = str(Path(sys.executable).parent)
    full["PATH"] = os.pathsep.join(p for p in full.get("PATH", "").split(os.pathsep) if p != venv_bin)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VIRTUAL_ENV"):
        full.pop(var, None)
    if cache is not None:
        full["DAPO_MCORE_CACHE"] = cache
    return subprocess.run([sys.executable, str(LAUNCH), *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout)


def _done(run_dir: Path) -> dict:
    """slurm/probe.py's done.json: world size, steps, restart count (its other keys, e.g. hosts, left out)."""
    done = json.loads((run_dir / "done.json").read_text())
    return {key: done[key] for key in ("world", "steps", "restart")}


@pytest.mark.unit
def test_slurm_dry_run_prints_the_32b_sbatch(tmp_path):
    remote = tmp_path / "shared" / "dapo-mcore"
    proc = launch(tmp_path, "slurm", "--account", "acct", "--partition", "batch", "--dry-run",
                  "--remote-repo", str(remote), "algo.clip_high=0.28")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S*))?$", out, flags=re.M))
    assert flags["nodes"] == "16" and flags["ntasks-per-node"] == "8" and flags["gpus-per-node"] == "8"
    assert flags["time"] == "12:00:00" and flags["signal"] == "USR1@3600"
    assert flags["account"] == "acct" and flags["partition"] == "batch" and "exclusive" in flags
    # Logs go to the run directory in the cluster checkout (shared storage), not the login node's /tmp.
    jobs = f"{remote}/runs/dapo-32b-fp8/nemo-run/"
    assert flags["output"].startswith(jobs), flags["output"]
    srun = next(line for line in out.splitlines() if line.startswith("srun "))
    assert re.search(rf"--output {re.escape(jobs)}\S+ ", srun), srun
    assert f"source {remote}/slurm/env.sh" in out and f"export DAPO_VENV={sys.prefix}" in out
    assert "export MASTER_ADDR=$head_node_ip" in out
    assert srun.rindex(f"--chdir {remote}") > srun.index("--chdir")  # the last --chdir wins
    # The layout lives in the config (TP=8 PP=2 on 16 x 8 GPUs); only the run dir and the user's overrides follow.
    assert srun.endswith("python examples/slurm_task.py -m dapo_mcore.cli train examples/qwen2.5-32b-fp8.yaml "
                         "run.dir=runs/dapo-32b-fp8 algo.clip_high=0.28"), srun
    assert "parallel." not in srun
    # NeMo-Run's own requeue (any non-zero exit) is off; the exit trap requeues when a task flagged exit 75.
    assert "export TORCHX_MAX_RETRIES=0" in out and "export DAPO_MAX_REQUEUES=20" in out
    assert f"export DAPO_REQUEUE_MARKER={jobs}requeue/" in out and "scontrol requeue" in out
    assert not remote.exists(), "the dry run leaves nothing behind"


@pytest.mark.unit
def test_slurm_refuses_a_signal_before_the_start_in_one_line(tmp_path):
    proc = launch(tmp_path, "slurm", "--time", "00:30:00", "--dry-run")  # --signal-seconds 3600 by default
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--signal-seconds 3600 is not less than --time 00:30:00" in proc.stderr


@pytest.mark.unit
def test_slurm_time_limits_in_seconds():
    sys.path.insert(0, str(LAUNCH.parent))
    try:
        from launch import slurm_seconds
    finally:
        sys.path.remove(str(LAUNCH.parent))
    assert [slurm_seconds(t) for t in ("90", "90:30", "12:00:00", "1-12", "1-12:30", "2-00:00:05")] == [
        5400, 5430, 43200, 129600, 131400, 172805]


@pytest.mark.distributed
def test_local_executor_runs_a_real_gloo_job(tmp_path):
    run_dir = tmp_path / "probe"
    proc = launch(tmp_path, "local", "--script", "slurm/probe.py", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _done(run_dir) == {"world": 2, "steps": 3, "restart": 0}


@pytest.mark.e2e
def test_local_executor_runs_the_tiny_trainer(tmp_path, tiny_cache):
    run_dir = tmp_path / "run"
    proc = launch(tmp_path, "local", "--run-dir", str(run_dir), "train.steps=3", "eval.every=0", "checkpoint.every=0",
                  timeout=900, cache=tiny_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SUCCEEDED" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    # torchrun started 2 ranks and the trainer split the model over them (TP=2): one shard per rank.
    model = run_dir / "checkpoints" / "step_000003" / "model"
    assert sorted(p.name for p in model.iterdir() if p.is_dir()) == ["mp_rank_00_000", "mp_rank_01_000"]


# --- SlurmExecutor on a real single-node Slurm ---------------------------------------------------------------------

def _port_base() -> int:
    """A rendezvous port base with free ports above it: private clusters number their jobs from 1."""
    for _ in range(50):
        base = random.randrange(20000, 60000 - 32)
        try:
            for port in range(base + 1, base + 33):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of 32 free ports for the rendezvous")


@pytest.fixture(scope="module")
def slurm(local_slurm, tiny_cache) -> dict[str, str]:
    return dict(local_slurm, OMP_NUM_THREADS="1", DAPO_MASTER_PORT_BASE=str(_port_base()), DAPO_MCORE_CACHE=tiny_cache)


def submit(tmp_path: Path, env: dict[str, str], run_dir: Path, *args: str) -> str:
    proc = launch(tmp_path, "slurm", *SLURM_CPU, "--run-dir", str(run_dir), *args, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return re.search(r"submitted slurm job (\d+)", proc.stdout).group(1)


def job_fields(env: dict[str, str], job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         check=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_for(predicate, timeout: float, what: str) -> None:
    """Generous deadlines: they only bound a failure (a loaded 2-core machine makes every job step slow)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


def wait_ended(env: dict[str, str], job_id: str, timeout: float = 900) -> dict[str, str]:
    """The job's final fields; a requeued job is released at once (slurmctld holds it ~2 min otherwise)."""
    released = set()

    def ended() -> bool:
        fields = job_fields(env, job_id)
        restarts = fields["Restarts"]
        if fields["JobState"] == "PENDING" and restarts != "0" and restarts not in released:
            time.sleep(2.0)  # slurmd refuses a credential from the same second as the requeue's revocation
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, check=True)
            released.add(restarts)
        return fields["JobState"] in ENDED

    try:
        wait_for(ended, timeout, f"job {job_id} to end")
    finally:
        if job_fields(env, job_id)["JobState"] not in ENDED:
            subprocess.run(["scancel", job_id], env=env, check=True)
    return job_fields(env, job_id)


def job_logs(run_dir: Path) -> str:
    logs = sorted((run_dir / "nemo-run").rglob("*.out"))
    assert logs, f"no logs under {run_dir / 'nemo-run'}"
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs)


EXIT_ONCE = """import os, sys
from pathlib import Path
restart, rank = int(os.environ.get("SLURM_RESTART_COUNT", "0")), os.environ["RANK"]
with open(Path(sys.argv[1]) / "runs.txt", "a") as fh:
    fh.write(f"{restart} {rank}\\n")
if restart == 0 and rank == "0":
    sys.exit(int(sys.argv[2]))
if restart == 0:
    import time; time.sleep(120)  # rank 1 is still running when rank 0 exits: srun kills it (--kill-on-bad-exit)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("code", [75, 2])
def test_slurm_executor_requeues_on_exit_75_only(local_slurm, tmp_path, code):
    """Rank 0 exits CODE on the first run while its peer still runs (so srun may report 137, not 75); the second
    run exits 0. Exit 75 is requeued once and completes; any other code fails the job with no requeue."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = tmp_path / "exit_once.py"
    script.write_text(EXIT_ONCE)
    job = submit(tmp_path, local_slurm, run_dir, "--ntasks-per-node", "2", "--script", str(script), str(code))
    fields = wait_ended(local_slurm, job)
    logs = job_logs(run_dir)
    runs = sorted((run_dir / "runs.txt").read_text().split("\n")[:-1])
    if code == 75:
        assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", logs
        assert runs == ["0 0", "0 1", "1 0", "1 1"] and f"requeueing job {job}" in logs
    else:
        assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", logs
        assert runs == ["0 0", "0 1"] and f"requeueing job {job}" not in logs


@pytest.mark.e2e
def test_slurm_executor_signal_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """What ``--signal=USR1@secs`` (no ``B:``) does: USR1 to the tasks; the probe checkpoints, exits 75, resumes."""
    run_dir = tmp_path / "run"
    job = submit(tmp_path, slurm, run_dir, "--ntasks-per-node", "2", "--script", "slurm/probe.py",
                 "--steps", "6", "--step-seconds", "1")
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2
             or job_fields(slurm, job)["JobState"] in ENDED, 600, "two probe steps")
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)  # the job's steps, not the batch shell
    fields = wait_ended(slurm, job)
    logs = job_logs(run_dir)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", logs
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6)), "resumed after the checkpointed step, none repeated"
    assert rows[0]["restart"] == 0 and rows[-1]["restart"] == 1 and all(r["sum"] == 3.0 for r in rows)
    assert _done(run_dir) == {"world": 2, "steps": 6, "restart": 1}


@pytest.mark.e2e
def test_slurm_executor_runs_the_tiny_trainer(slurm, tmp_path):
    """The trainer on 2 Slurm tasks (TP=2, gloo), python from the launcher's venv (DAPO_VENV, not on PATH)."""
    run_dir = tmp_path / "run"
    job = submit(tmp_path, slurm, run_dir, "--ntasks-per-node", "2", "--config", "examples/tiny_cpu.yaml",
                 "parallel.tensor_parallel=2", "train.steps=2", "eval.every=0",
                 "checkpoint.every=0")
    fields = wait_ended(slurm, job)
    logs = job_logs(run_dir)
    assert fields["JobState"] == "COMPLETED", logs[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    model = run_dir / "checkpoints" / "step_000002" / "model"
    assert sorted(p.name for p in model.iterdir() if p.is_dir()) == ["mp_rank_00_000", "mp_rank_01_000"]
