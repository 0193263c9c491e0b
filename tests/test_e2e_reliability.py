"""End-to-end reliability through the CLI: two runs on one run directory, and the kill/restart soak.

Shares the tiny-run setup (and base-model cache) of test_e2e_tiny.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import TWO_STEPS, copy_run

from tests.test_e2e_tiny import ROOT, TIMEOUT, _by_step, _cmd, _logged_steps, _metrics, _run, _wait_for, env  # noqa: F401

pytestmark = pytest.mark.e2e

FAST = ("eval.every=0", "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=1")


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("dapo-mcore:")]
    assert len(lines) == 1 and stderr.strip().endswith(lines[0]), stderr[-3000:]
    assert "Traceback" not in stderr
    return lines[0]


def test_a_second_train_on_the_same_directory_is_refused_and_the_first_loses_nothing(env, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    first = subprocess.Popen(_cmd(run_dir, "train.steps=1000", *FAST), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: 1 in _logged_steps(run_dir), first, "the first run's step 1")
    second = _run(_cmd(run_dir, "train.steps=2", *FAST), env)  # old code: "already finished", exit 0
    assert first.poll() is None, "the first run must still be running"
    first.send_signal(signal.SIGTERM)  # checkpoints after its current step and exits 75
    _, err = first.communicate(timeout=TIMEOUT)
    assert second.returncode == 2, second.stderr[-3000:]
    line = _error_line(second.stderr)
    assert f"run directory {run_dir} is in use by another run" in line and f"pid {first.pid}" in line, line
    assert first.returncode == 75, err[-3000:]
    steps = _logged_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2, steps
    assert len((run_dir / "ledger.jsonl").read_text().splitlines()) == len(steps)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{len(steps):06d}"


def test_a_non_finite_update_stops_the_run_in_one_line_and_leaves_only_finite_checkpoints(env, tmp_path):  # noqa: F811
    run_dir = tmp_path / "nan"
    done = _run(_cmd(run_dir, "train.steps=3", "optim.lr=1e6", "optim.grad_clip=0", *FAST), env)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _error_line(done.stderr)
    assert "a non-finite update (loss" in line and "optim.lr (now 1e+06" in line, line
    from dapo_mcore.actor.checkpoint import check_intact

    ckpts = sorted((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").is_dir() else []
    assert all(check_intact(c) == [] for c in ckpts), ckpts  # whatever was saved is finite
    again = _run(_cmd(run_dir, "train.steps=3", "optim.lr=1e6", "optim.grad_clip=0", *FAST), env)
    assert again.returncode == 2 and _error_line(again.stderr) == line  # the resume says the same, no crash


def test_a_failing_reward_stops_the_run_in_one_line_quoting_its_error(env, tmp_path):  # noqa: F811
    (tmp_path / "broken_reward.py").write_text("def score(response, gt):\n    raise KeyError('no grader for ' + gt)\n")
    env = {**env, "PYTHONPATH": f"{tmp_path}:{env['PYTHONPATH']}"}
    done = _run(_cmd(tmp_path / "run", "train.steps=2", "reward.name=broken_reward:score", "reward.workers=1",
                     *FAST), env)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _error_line(done.stderr)
    assert "reward broken_reward:score failed on" in line and "KeyError: 'no grader for" in line, line


@pytest.mark.parametrize("store", ["true", "false"])
def test_a_damaged_rollout_store_never_blocks_a_resume(env, finished_two_steps, tmp_path, store):  # noqa: F811
    assert set(TWO_STEPS) == {"train.steps=2", *FAST}  # the session's finished run is train.steps=2 + FAST
    run_dir = copy_run(finished_two_steps, tmp_path / "run")
    zarr_dir = run_dir / "rollouts.zarr"
    chunk = zarr_dir / "response_ids" / "c" / "0"
    chunk.write_bytes(chunk.read_bytes()[:20])  # truncated: the Zstd error that blocked resumes
    (zarr_dir / "zarr.json").write_text((zarr_dir / "zarr.json").read_text()[:50])  # half-written root
    rep = _run([sys.executable, "-m", "dapo_mcore.cli", "report", str(run_dir)], env)
    assert rep.returncode == 0 and "rollout store" in rep.stderr and "damaged" in rep.stderr, rep.stderr[-2000:]
    done = _run(_cmd(run_dir, "train.steps=3", f"run.rollout_store={store}", *FAST), env)
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [ln for ln in done.stderr.splitlines() if "rollout store" in ln and "is damaged" in ln]
    assert len(warned) == 1 and "moved aside" in warned[0], done.stderr[-3000:]
    assert (run_dir / "rollouts.zarr.damaged-1" / "response_ids").is_dir()  # nothing deleted
    if store == "true":
        from dapo_mcore.telemetry.rollout_store import RolloutReader

        assert RolloutReader(zarr_dir).steps() == [3]
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]


SOAK_CYCLES = 3
SOAK = ("train.steps=5", "eval.every=0", "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=1")


def test_soak_two_starts_at_a_time_killed_at_random_moments_end_as_an_uninterrupted_run(env, tmp_path):  # noqa: F811
    """Bounded (3 cycles, one deadline): each cycle starts two runs on one directory a random 0-2 s apart (one is
    refused in one line), then kill -9s the holder at a random moment; a last start finishes the run. Its record
    must equal the uninterrupted run's exactly. DAPO_MCORE_SOAK_SEED picks other moments."""
    rng = random.Random(int(os.environ.get("DAPO_MCORE_SOAK_SEED", "29")))
    reference = tmp_path / "reference"
    assert _run(_cmd(reference, *SOAK), env).returncode == 0
    run_dir = tmp_path / "soak"
    deadline = time.monotonic() + TIMEOUT
    refused = 0
    for _ in range(SOAK_CYCLES):
        procs = [subprocess.Popen(_cmd(run_dir, *SOAK), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)]
        time.sleep(rng.uniform(0, 2))
        procs.append(subprocess.Popen(_cmd(run_dir, *SOAK), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
        while all(p.poll() is None for p in procs):  # the loser stops at the lock (or one finished the run)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first = next(p for p in procs if p.poll() is not None)
        other = procs[1 - procs.index(first)]
        err = first.stderr.read()
        if first.returncode == 2:
            assert "is in use by another run" in _error_line(err), err[-2000:]
            refused += 1
        else:
            assert first.returncode == 0, err[-3000:]
        time.sleep(rng.uniform(0, 8))  # the holder's random moment: start-up, a step, a checkpoint save
        if other.poll() is None:
            other.kill()
        other.wait(timeout=TIMEOUT)
        other.stderr.read()
    done = _run(_cmd(run_dir, *SOAK), env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert refused >= 1  # two runs did overlap on the directory
    a, b = _metrics(reference), _metrics(run_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5], "every step logged exactly once"
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rollout/acc_mean", "train/entropy"):
        assert _by_step(a, key) == _by_step(b, key), key
    assert len((run_dir / "ledger.jsonl").read_text().splitlines()) == 5
