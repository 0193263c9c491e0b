"""End to end through a real single-node Slurm: sbatch slurm/tiny_cpu.sbatch -> slurm/launch.sh -> 2 tasks.

The fixture starts munged + slurmctld + slurmd from slurm/local/start.sh in a temp dir for this module
and stops them by pid afterwards. Needs root and `slurm/local/install.sh` (Debian: slurmctld slurmd
slurm-client munge); skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dapo_mcore.telemetry.rollout_store import RolloutReader

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "slurm" / "tiny_cpu.sbatch"
PROBE = ["python", "slurm/probe.py"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def free_port_base(span: int = 32) -> int:
    """A rendezvous port base whose next ``span`` ports are free: each private cluster numbers its jobs from 1,
    so two test sessions on one host would otherwise both rendezvous on 20001 (launch.sh: base + job id)."""
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20000, 60000 - span)
        try:
            for port in range(base + 1, base + span + 1):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no run of {span} free ports found for the rendezvous")


@pytest.fixture(scope="module")
def slurm_env(local_slurm, tiny_cache):
    """The local Slurm (conftest's ``local_slurm``) with what a job of this checkout needs: its python first on
    PATH and in PYTHONPATH, the session's tiny-base cache, a private master-port range, no inherited rank variables."""
    env = dict(local_slurm, DAPO_REPO=str(REPO), OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"),
               DAPO_MCORE_CACHE=tiny_cache, DAPO_MASTER_PORT_BASE=str(free_port_base()))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def sbatch(env, out: Path, *cmd: str, wait: bool = True) -> subprocess.CompletedProcess:
    """Submit slurm/tiny_cpu.sbatch; with ``wait``, return once the job ended, with its exit code as returncode.

    Polls the job state itself rather than ``sbatch --wait``, which checks only every ~10 s.
    """
    args = ["sbatch", "--parsable", f"--output={out}", str(TINY), *cmd]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if not wait or proc.returncode != 0:
        return proc
    job_id = proc.stdout.strip().split(";")[0]
    wait_for(lambda: job_state(env, job_id) in ENDED, 1800, f"job {job_id} to end")
    fields = job_fields(env, job_id)
    status, sig = (int(x) for x in fields["ExitCode"].split(":"))
    proc.returncode = 128 + sig if sig else status
    return proc


def job_fields(env, job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         check=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def job_state(env, job_id: str) -> str:
    return job_fields(env, job_id)["JobState"]


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.5 s. Deadlines in this module are generous (minutes): they only bound a failure,
    and at a load average of ~10 on 2 cores every step of a job (imports, rendezvous, srun) is several times slower."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


def release_requeued(env, job_id: str) -> None:
    """Start a requeued job now instead of after slurmctld's ~2 min hold (BeginTime).

    slurmd refuses a job credential created in the same second as the requeue's revocation ("Job credential
    revoked": it compares whole seconds), so wait past that second first.
    """
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, check=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gloo_probe_runs_two_tasks_through_launch(slurm_env, tmp_path):
    proc = sbatch(slurm_env, tmp_path / "job.out", *PROBE, str(tmp_path / "run"), "--steps", "3")
    log = (tmp_path / "job.out").read_text()
    assert proc.returncode == 0, proc.stderr + log
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in rows)  # all_reduce of rank+1 over 2 ranks
    assert json.loads((tmp_path / "run" / "done.json").read_text())["restart"] == 0
    assert "rendezvous" in log and "step exited with 0" in log


def test_failing_task_fails_the_job_without_requeue(slurm_env, tmp_path):
    proc = sbatch(slurm_env, tmp_path / "job.out", "python", "-c", "import sys; sys.exit(3)")
    log = (tmp_path / "job.out").read_text()
    assert proc.returncode != 0, log
    assert "step exited with 3" in log and "requeueing" not in log


PROBE_STEPS = 24  # 1 s each: >= 20 s of runway after the second step for the signal to land mid-run, at any load


def test_signal_checkpoints_requeues_and_resumes(slurm_env, tmp_path):
    run, out = tmp_path / "run", tmp_path / "job.out"
    proc = sbatch(slurm_env, out, *PROBE, str(run), "--steps", str(PROBE_STEPS), "--step-seconds", "1", wait=False)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    metrics = run / "metrics.jsonl"
    try:
        # Two logged steps: srun runs and launch.sh waits on it with its trap set (it is set before srun starts).
        wait_for(lambda: metrics.exists() and len(read_jsonl(metrics)) >= 2, 600, "two probe steps")
        # What Slurm does at `--signal=B:USR1@secs`: signal the batch shell only.
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm_env, check=True)
        wait_for(lambda: (run / "checkpoint.json").exists() or job_state(slurm_env, job_id) in ENDED, 600,
                 "the checkpoint")
        assert (run / "checkpoint.json").exists(), f"the job ended without the signal's checkpoint:\n{out.read_text()}"
        wait_for(lambda: job_state(slurm_env, job_id) == "PENDING", 600, "the requeue")
        release_requeued(slurm_env, job_id)
        wait_for(lambda: job_state(slurm_env, job_id) in ENDED, 600, "the job to end")
    finally:
        _cancel_if_running(slurm_env, job_id)
    log = out.read_text()
    assert job_state(slurm_env, job_id) == "COMPLETED", log
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(PROBE_STEPS)), "resumed after the checkpointed step, no step repeated"
    assert rows[0]["restart"] == 0 and rows[-1]["restart"] == 1
    for line in ("got SIGUSR1: forwarding to srun", f"requeueing job {job_id} (restart 1)", f"job {job_id} restart 1:"):
        assert line in log, f"{line!r} missing from the job's log:\n{log}"
    # The first rank to exit 75 gets its peer sent SIGTERM (srun --kill-on-bad-exit); the task wrapper outlives it
    # and reports its command's 75, so srun reports 75 (not 128 + SIGTERM), the only code launch.sh requeues on.
    exits = [int(code) for code in re.findall(r"step exited with (\d+)", log)]
    assert exits == [75, 0], log


def _cancel_if_running(env, job_id: str) -> None:
    """A hung or late job must not outlive the test (or hold the node for the next one)."""
    if job_state(env, job_id) not in ENDED:
        subprocess.run(["scancel", job_id], env=env, check=True)
        wait_for(lambda: job_state(env, job_id) in ENDED, 300, "the cancelled job to end")


def train_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows of training steps (the base-model eval row, if any, is step 0 without train/loss)."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]


def test_tiny_trainer_job(slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(slurm_env, RUN_DIR=str(run_dir))
    # tiny_cpu.sbatch's own trainer command (TP=2 on 2 gloo tasks), shortened by overrides.
    proc = sbatch(env, tmp_path / "job.out", "train.steps=4", "eval.every=2", "checkpoint.every=2")
    log = (tmp_path / "job.out").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "2 tasks on 1 node(s)" in log and "step exited with 0" in log
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["train/loss"]) and r["train/updates"] == 4 for r in rows)
    assert [r["step"] for r in rows if "eval/avg_at_k" in r] == [2, 4]
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["parallel"]["tensor_parallel"] == 2 and resolved["train"]["steps"] == 4
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000004"
    ckpt = run_dir / "checkpoints" / "step_000004"
    assert (ckpt / "COMPLETE").is_file()
    # Two tasks, TP=2: one model shard and one RNG state per rank.
    assert sorted(p.name for p in (ckpt / "model").iterdir() if p.is_dir()) == ["mp_rank_00_000", "mp_rank_01_000"]
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert RolloutReader(run_dir / "rollouts.zarr").steps() == [1, 2, 3, 4]


REQUEUE_STEPS = 30  # ~0.5 s each on 2 idle cores: runway for the signal to land mid-run

@pytest.fixture(scope="module")
def requeued_run(slurm_env, tmp_path_factory) -> tuple[Path, str, int]:
    """The tiny trainer signalled mid-run: (run dir, Slurm log, step of the signal's checkpoint)."""
    tmp = tmp_path_factory.mktemp("requeue")
    run_dir, out = tmp / "run", tmp / "job.out"
    env = dict(slurm_env, RUN_DIR=str(run_dir))
    proc = sbatch(env, out, f"train.steps={REQUEUE_STEPS}", "eval.every=10", "checkpoint.every=0", wait=False)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(train_rows(run_dir)) >= 2, 1200,
                 "two trainer steps")
        # What Slurm does at `--signal=B:USR1@secs`: signal the batch shell, which forwards to srun.
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm_env, check=True)
        wait_for(lambda: job_state(slurm_env, job_id) == "PENDING", 600, "the requeue")
        # checkpoint.every=0: the only checkpoint before the end is the one the signal asked for.
        stopped_at = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
        release_requeued(slurm_env, job_id)
        wait_for(lambda: job_state(slurm_env, job_id) in ENDED, 1200, "the job to end")
    finally:
        _cancel_if_running(slurm_env, job_id)
    log = out.read_text()
    assert job_state(slurm_env, job_id) == "COMPLETED", log[-4000:]
    return run_dir, log, stopped_at


def test_tiny_trainer_signal_checkpoints_requeues_and_resumes(requeued_run):
    run_dir, log, stopped_at = requeued_run
    assert 2 <= stopped_at < REQUEUE_STEPS
    assert "got SIGUSR1: forwarding to srun" in log and "step exited with 0" in log
    assert log.count("requeueing job") == 1 and "restart 1:" in log
    assert f"step_{stopped_at:06d}" in log.split("restart 1:")[1], "the restarted job loads the signal's checkpoint"
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, REQUEUE_STEPS + 1)), "every step exactly once"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{REQUEUE_STEPS:06d}"
    assert RolloutReader(run_dir / "rollouts.zarr").steps() == list(range(1, REQUEUE_STEPS + 1))


def test_tiny_trainer_requeue_keeps_the_cost_ledger_whole(requeued_run):
    run_dir, _, stopped_at = requeued_run
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, REQUEUE_STEPS + 1)), f"signal checkpoint at {stopped_at}"
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    per_step = sum(r["cost/step/rollouts_generated"] for r in ledger)
    assert last["cost/total/rollouts_generated"] == per_step


def test_stop_cancels_jobs_left_running(slurm_env, tmp_path):
    """Last in this module: stop.sh takes the cluster down, leaving no task behind (here a 'hung' sleep)."""
    pid_file = tmp_path / "task.pid"
    proc = sbatch(slurm_env, tmp_path / "job.out", "bash", "-c", f'echo $$ > {pid_file}; exec sleep 600', wait=False)
    assert proc.returncode == 0, proc.stderr
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 600, "the task to start")
    pid = int(pid_file.read_text())
    subprocess.run([str(REPO / "slurm/local/stop.sh"), str(Path(slurm_env["SLURM_CONF"]).parent)], check=True,
                   capture_output=True, text=True)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, 300, f"the task (pid {pid}) to be gone after stop.sh")
    log = (tmp_path / "job.out").read_text()
    # stop.sh ends jobs with scancel (SIGTERM): launch.sh forwards it but must not requeue a cancelled job.
    assert "got SIGTERM: forwarding to srun" in log and "not requeueing" in log and "requeueing job" not in log
