"""The run-directory lock: one holder at a time, named to the second; a dead holder cannot keep it; all ranks agree."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dapo_mcore.run import lock as run_lock
from tests.gloo_workers import run_gloo_workers

HOLD = textwrap.dedent("""
    import sys, time
    from dapo_mcore.run import lock as run_lock
    lock = run_lock.acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


def _holder(run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.unit
def test_a_second_holder_is_refused_naming_the_first_and_gets_it_once_the_first_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    first = _holder(run_dir, {"SLURM_JOB_ID": "4242"})
    try:
        with pytest.raises(run_lock.RunLockedError) as refused:
            run_lock.acquire(run_dir)
        msg = str(refused.value)
        assert f"run directory {run_dir} is in use by another run" in msg
        assert f"host {socket.gethostname()}, pid {first.pid}, Slurm job 4242" in msg
        assert "\n" not in msg and "use another run.dir" in msg
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    lock = run_lock.acquire(run_dir)  # kill -9 frees it: a requeued job is never locked out by a dead one
    try:
        info = json.loads((run_dir / run_lock.LOCK_NAME).read_text())
        assert info["pid"] == os.getpid()
        with pytest.raises(run_lock.RunLockedError, match=f"pid {os.getpid()}"):
            run_lock.acquire(run_dir)  # a second claim from the same process conflicts too
    finally:
        lock.release()
    run_lock.acquire(run_dir).release()  # released means free
    assert (run_dir / run_lock.LOCK_NAME).is_file()


def _claim_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    run_dir = Path(os.environ["LOCK_TEST_DIR"])
    try:
        lock = run_lock.claim(run_dir, rank)
        queue.put((rank, ("held", lock is not None)))
    except run_lock.RunLockedError as exc:
        queue.put((rank, ("refused", str(exc))))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_every_rank_of_a_refused_job_stops_with_rank_0s_line(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("LOCK_TEST_DIR", str(run_dir))
    first = _holder(run_dir)
    try:
        got = run_gloo_workers(_claim_worker, 2, timeout_s=300)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert got[0][0] == got[1][0] == "refused", got
    assert got[0][1] == got[1][1] and f"pid {first.pid}" in got[0][1]
    free = run_gloo_workers(_claim_worker, 2, timeout_s=300)
    assert free == {0: ("held", True), 1: ("held", False)}  # rank 0 holds it; the others hold nothing


@pytest.mark.unit
def test_a_holder_that_never_wrote_its_name_is_still_refused(tmp_path):
    run_dir = tmp_path / "run"
    first = _holder(run_dir)
    try:
        (run_dir / run_lock.LOCK_NAME).write_text("")  # the instant between taking the lock and writing the name
        with pytest.raises(run_lock.RunLockedError, match="has not written"):
            run_lock.acquire(run_dir)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    start = time.monotonic()
    run_lock.acquire(run_dir).release()
    assert time.monotonic() - start < 60


@pytest.mark.unit
def test_overwrite_empties_the_directory_only_once_the_lock_is_held(tmp_path):
    from dapo_mcore.actor.parallel import LaunchEnv
    from dapo_mcore.config import load_config
    from dapo_mcore.run.directory import claim_run_dir, prepare_run_dir

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = load_config(None, ["model.tiny_base=true", f"run.dir={run_dir}", "run.overwrite=true"])
    rank0 = LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, source="test")
    first = _holder(run_dir)
    try:
        prepare_run_dir(cfg, rank0)  # checks only: deletes nothing
        with pytest.raises(run_lock.RunLockedError):
            claim_run_dir(cfg, rank0)
        assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "checkpoints").is_dir()  # the holder's files stay
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    lock = claim_run_dir(cfg, rank0)
    try:
        assert sorted(p.name for p in run_dir.iterdir()) == [run_lock.LOCK_NAME] and lock.held
    finally:
        lock.release()
