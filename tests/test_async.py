"""The async disaggregated mode in real runs: gloo ranks, the transformers engine, the tiny base.

One reference run (1 trainer rank + 1 engine rank) and the same run interrupted by kill -9 during a weight transfer,
kill -9 of an engine rank mid-generation, and SIGTERM (checkpoint, exit 75): each resumed run's record equals the
reference's at every step, so the steps before the interruption (a repeat of the reference) and after it (the
resume) are both exact. At the real shape: trainer DP=2 beside two engine ranks (4 processes) is a second
reference, TP=2 beside them trains on the same batches, and kill -9 of one of the two engine ranks resumes exactly;
two engine ranks stream with partial rollouts, whose prefixes lag two versions. Every run's weights group refuses
tensors off its device, as NCCL does (DAPO_MCORE_STRICT_DEVICE=1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo_mcore.config import ConfigError, load_config

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 1800  # bounds a hang only; ~20 s a run on 2 idle cores
ASYNC = ("rollout.pipeline.mode=async", "algo.tis_cap=2.0", "rollout.pipeline.bucket_mb=0.02",
         "eval.every=0", "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=1")
EXACT = ("train/loss", "train/grad_norm", "train/entropy", "rollout/acc_mean", "sampling/tokens_generated",
         "mismatch/kl", "async/lag_mean", "async/policy_version")


def _cmd(run_dir: Path, steps: int, nproc: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "dapo_mcore.cli",
            "train", str(ROOT / "examples" / "tiny_cpu.yaml"), f"run.dir={run_dir}", f"train.steps={steps}",
            *ASYNC, *extra]


def _strict(env: dict[str, str]) -> dict[str, str]:
    """The weights group refuses tensors off its device, as NCCL does on a GPU (collectives.device)."""
    return dict(env, DAPO_MCORE_STRICT_DEVICE="1")


def _train(run_dir: Path, env: dict[str, str], steps: int = 3, nproc: int = 2, *extra: str,
           fault: str | None = None) -> subprocess.CompletedProcess:
    full = _strict(dict(env, DAPO_MCORE_FAULT=fault) if fault else env)
    return subprocess.run(_cmd(run_dir, steps, nproc, *extra), env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT)


def _rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in (json.loads(line) for line in lines if line.strip())}


def _same(a: Path, b: Path, keys=EXACT) -> None:
    ra, rb = _rows(a), _rows(b)
    assert sorted(ra) == sorted(rb), (sorted(ra), sorted(rb))
    for step in ra:
        for key in keys:
            assert ra[step].get(key) == rb[step].get(key), (step, key, ra[step].get(key), rb[step].get(key))


def _charges_devices(run: Path, devices: int) -> None:
    """The cost ledger charges every rank of the job, trainer and engines: device-seconds = ranks x step seconds."""
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines() if x.strip()]
    assert ledger
    for r in ledger:
        assert r["cost/step/device_seconds"] == pytest.approx(devices * r["cost/step/seconds_step"], rel=1e-6), r


@pytest.fixture(scope="module")
def reference(cli_env, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("async") / "reference"
    proc = _train(run, cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_the_reference_trains_every_token_one_version_behind_and_overlaps(reference):
    rows = _rows(reference)
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["async/policy_version"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]  # batch k by version max(0, k-1)
    assert [rows[s]["async/lag_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert rows[3]["async/lag_mean"] == 1.0
    for key in ("async/trainer_wait_s", "async/engine_wait_weights_s", "async/weights_transfer_s",
                "async/engine_generate_s"):
        assert all(rows[s][key] >= 0 for s in rows), key
    assert all(0.0 <= rows[s]["async/overlap_frac"] <= 1.0 for s in rows)
    # The cost ledger charges both sides: two ranks' device-seconds.
    _charges_devices(reference, 2)
    # Each checkpoint before the last holds the batch the engines generated for the next step.
    assert (reference / "checkpoints" / "step_000002" / "rollouts_pending.pkl").is_file()
    assert not (reference / "checkpoints" / "step_000003" / "rollouts_pending.pkl").exists()


@pytest.mark.parametrize("fault", ["publish:2:1", "generate:2"])
def test_kill9_during_a_weight_transfer_or_a_generation_resumes_exactly(reference, cli_env, tmp_path, fault):
    run = tmp_path / "run"
    killed = _train(run, cli_env, fault=fault)
    assert killed.returncode != 0 and "killing this process (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert len(_rows(run)) < 3
    resumed = _train(run, cli_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stderr
    _same(reference, run)


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(reference, cli_env, tmp_path):
    run = tmp_path / "run"
    # The whole held-out set in the closing evaluation (as the reference's trajectory, its steps, do not depend on):
    # the signal, sent once step 1 is logged, must find the run still going under any machine load.
    whole_eval = "eval.max_prompts=null"
    proc = subprocess.Popen(_cmd(run, 3, 2, whole_eval), env=_strict(cli_env), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT
    while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    import psutil

    for child in psutil.Process(proc.pid).children():  # Slurm signals every task of the step
        os.kill(child.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert "exiting 75" in err, err[-3000:]
    assert len(_rows(run)) < 3
    resumed = _train(run, cli_env, 3, 2, whole_eval)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same(reference, run)


TWO_ENGINES = ("rollout.pipeline.engine_ranks=2",)


@pytest.fixture(scope="module")
def reference_dp2(cli_env, tmp_path_factory) -> Path:
    """The real shape: trainer DP=2 beside 2 engine ranks (4 processes)."""
    run = tmp_path_factory.mktemp("async_dp2") / "reference"
    proc = _train(run, cli_env, 3, 4, *TWO_ENGINES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_trainer_dp2_beside_two_engine_ranks_trains_one_version_behind(reference_dp2):
    rows = _rows(reference_dp2)
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["async/lag_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    _charges_devices(reference_dp2, 4)


def test_trainer_tp2_beside_two_engine_ranks_trains_on_the_same_batches(reference_dp2, cli_env, tmp_path):
    """TP=2 instead of DP=2 on the trainer side: the engines' batches are DP=2's, and the training matches it within
    float noise (the sums run in another order)."""
    run = tmp_path / "run"
    proc = _train(run, cli_env, 3, 4, *TWO_ENGINES, "parallel.tensor_parallel=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ra, rb = _rows(reference_dp2), _rows(run)
    assert sorted(ra) == sorted(rb)
    for step in ra:
        assert ra[step]["sampling/tokens_generated"] == rb[step]["sampling/tokens_generated"], step
        assert ra[step]["async/lag_mean"] == rb[step]["async/lag_mean"]
        assert ra[step]["train/loss"] == pytest.approx(rb[step]["train/loss"], rel=1e-3, abs=1e-5), step


def test_kill9_of_one_of_two_engine_ranks_mid_generation_resumes_exactly(reference_dp2, cli_env, tmp_path):
    """Engine rank 1 (job rank 3) is killed as it starts generating batch 2; the other engine rank, the trainer
    ranks and torchrun stop; the resumed run's record equals the uninterrupted one's at every step."""
    run = tmp_path / "run"
    killed = _train(run, cli_env, 3, 4, *TWO_ENGINES, fault="generate:2@3")
    assert killed.returncode != 0 and "killing this process (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert killed.stderr.count("killing this process (SIGKILL)") == 1  # one engine rank only
    assert len(_rows(run)) < 3
    resumed = _train(run, cli_env, 3, 4, *TWO_ENGINES)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same(reference_dp2, run)


@pytest.mark.parametrize("order", ["prompt", "completion"])
def test_two_engine_ranks_stream_with_partial_rollouts_two_versions_behind(cli_env, tmp_path, order):
    run = tmp_path / "run"
    proc = _train(run, cli_env, 3, 3, "rollout.pipeline.engine_ranks=2", "rollout.pipeline.max_staleness=2",
                  "rollout.schedule.streaming=true", "rollout.schedule.stream_chunk_prompts=16",
                  "rollout.schedule.partial=true", "rollout.schedule.exchange_every=2", "train.prompts_per_step=4",
                  f"rollout.schedule.order={order}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chunk by chunk" not in proc.stderr, "two engine ranks fell back to chunked generation"
    rows = _rows(run)
    stale = {s: r["sampling/tokens_stale_kept"] for s, r in rows.items()}
    assert any(stale.values()), stale
    for step, r in rows.items():
        k = step - 1  # steps done before it
        fresh, prefix = k - max(0, k - 1), k - max(0, k - 2)  # batch k by version k-1, its prefixes by k-2's batch
        assert r["async/lag_max"] == (max(fresh, prefix) if stale[step] else fresh), (step, r["async/lag_max"])
        # the staleness histogram: every lag up to the bound, the prefixes' tokens at their lag, nothing beyond lag_max
        hist = {lag: r[f"staleness/tokens_lag_{lag}"] for lag in range(3)}
        assert max(lag for lag, n in hist.items() if n) == r["async/lag_max"], (step, hist)
        if prefix != fresh:
            assert hist[prefix] == stale[step], (step, hist, stale[step])
        mean = sum(lag * n for lag, n in hist.items()) / sum(hist.values())
        assert mean == pytest.approx(r["async/lag_mean"]), (step, hist)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.pipeline.mode=async"], "rollout.pipeline.mode=async trains on responses the previous policy sampled"
                                      "; it needs an off-policy correction: set algo.tis_cap"),
    (["rollout.pipeline.mode=async", "algo.tis_cap=2", "rollout.schedule.streaming=true",
      "rollout.schedule.partial=true"], "set rollout.pipeline.max_staleness=2"),
    (["rollout.pipeline.mode=async", "algo.tis_cap=2", "rollout.pipeline.engine_ranks=2"],
     "rollout.pipeline.engine_ranks=2 leaves no trainer rank of the 2 launched: launch 3 processes"),
    (["rollout.pipeline.max_staleness=2"], "rollout.pipeline.max_staleness=2 bounds how far the engines of "
                                           "rollout.pipeline.mode=async run ahead"),
    (["rollout.pipeline.mode=async", "rollout.pipeline.max_staleness=2",
      "algo.rollout_correction.preset=bypass_ppo_clip"],
     "its PPO clip would be anchored to a policy 2 versions older"),
    (["rollout.pipeline.mode=async", "rollout.pipeline.max_staleness=0", "algo.tis_cap=2"],
     "rollout.pipeline.max_staleness"),
])
def test_async_configs_that_cannot_work_are_refused_naming_the_key(overrides, message):
    cfg = load_config(ROOT / "examples" / "tiny_cpu.yaml", overrides)
    with pytest.raises(ConfigError) as info:
        cfg.validate(2)
    assert message in str(info.value)


def test_a_finished_run_started_again_does_nothing(reference, cli_env, tmp_path):
    """Answered before any rank starts (the finished-run fast path, cli): no engine rank is left waiting."""
    import shutil

    run = tmp_path / "again"
    shutil.copytree(reference, run)
    proc = _train(run, cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to do" in proc.stderr
    assert _rows(run) == _rows(reference)


def test_dynamic_sampling_exhausted_on_the_engine_ranks_stops_the_run_in_one_line(cli_env, tmp_path):
    """One generation round of as many prompts as the step needs cannot fill it (some groups are all right):
    the engine rank's DynamicSamplingExhausted reaches the trainer, which says so and exits 1; nobody hangs."""
    proc = _train(tmp_path / "run", cli_env, 2, 2, "algo.max_gen_batches=1", "rollout.gen_batch_prompts=16")
    assert proc.returncode != 0
    assert "dynamic sampling kept" in proc.stderr and "algo.max_gen_batches=1" in proc.stderr, proc.stderr[-3000:]
    # torchrun prints its own ChildFailedError for any non-zero exit; no traceback comes from the project's code.
    assert "dapo_mcore/" not in "".join(line for line in proc.stderr.splitlines() if line.lstrip().startswith("File"))


def test_rebucket_and_flatten_round_trip_mixed_dtypes():
    """The weight transfer's buckets: the same tensors in the same order, at most ``limit`` bytes each unless one
    tensor alone exceeds it, and a flattened bucket (one byte buffer, any dtypes) cut back into equal tensors."""
    import torch

    from dapo_mcore.rollout.pipeline.async_source import flatten_bucket, rebucket, unflatten_bucket

    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g).to(torch.bfloat16)),
               ("c", torch.arange(7, dtype=torch.int64)), ("d", torch.randn(40, generator=g))]
    out = list(rebucket([tensors[:2], tensors[2:]], limit=64))
    assert [n for b in out for n, _ in b] == ["a", "b", "c", "d"]
    # a 48 B + b 10 B fit in 64; c (56 B) starts a bucket; d (160 B) exceeds the limit alone
    assert [[n for n, _ in b] for b in out] == [["a", "b"], ["c"], ["d"]]
    for bucket in out:
        meta, flat = flatten_bucket(bucket)
        assert flat.dtype == torch.uint8 and flat.numel() == sum(-(-t.numel() * t.element_size() // 16) * 16
                                                                 for _, t in bucket)
        for (name, want), (got_name, got) in zip(bucket, unflatten_bucket(meta, flat.clone()), strict=True):
            assert name == got_name and got.dtype == want.dtype and torch.equal(got, want)
    # A bf16 tensor of odd length before an fp32 one: the fp32 view started at byte 6, which torch refuses ("must be
    # divisible by 4") and a GPU kernel would read unaligned; each tensor now starts at a multiple of 16 bytes.
    odd = [("x", torch.ones(3, dtype=torch.bfloat16)), ("y", torch.arange(4, dtype=torch.float32)),
           ("z", torch.arange(3, dtype=torch.int64))]
    meta, flat = flatten_bucket(odd)
    flat = flat.clone()
    got = unflatten_bucket(meta, flat)
    assert [(t.data_ptr() - flat.data_ptr()) % 16 for _, t in got] == [0, 0, 0]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(odd, got, strict=True))


def test_raising_train_steps_on_a_finished_run_trains_the_new_steps(reference, cli_env, tmp_path):
    """A finished run's last checkpoint holds no pending batch: the engines generate batch s with the version they
    get (lag 0) instead of waiting for a batch s the trainer never asked for (a deadlock otherwise)."""
    import shutil

    run = tmp_path / "more"
    shutil.copytree(reference, run)
    proc = _train(run, cli_env, 4, 2, "parallel.timeout_minutes=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(run)
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[4]["async/policy_version"] == 3.0 and rows[4]["async/lag_max"] == 0.0


def test_a_reward_failing_during_an_engine_evaluation_stops_the_run_in_one_line(cli_env, tmp_path):
    """The first thing the engines do is evaluate version 0 (eval.at_start): a reward that always raises fails
    there, outside the generation loop. The trainer reports the reward's error in one line (exit 2, as in sync
    mode; torchrun then exits 1); no rank prints a traceback (not only "another rank
    stopped")."""
    (tmp_path / "broken_reward.py").write_text("def score(response, gt):\n    raise KeyError('no grader for ' + gt)\n")
    env = {**cli_env, "PYTHONPATH": f"{tmp_path}:{cli_env['PYTHONPATH']}"}
    proc = _train(tmp_path / "run", env, 2, 2, "eval.at_start=true", "reward.name=broken_reward:score",
                  "reward.workers=1")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "dapo-mcore:" in line]
    assert len(errors) == 1 and "reward broken_reward:score failed on" in errors[0] and "KeyError" in errors[0], \
        proc.stderr[-3000:]
    assert "on the engine ranks:" in errors[0]  # the trainer's line: the failure reached it
    assert "exitcode: 2" in proc.stderr  # the trainer's code, as in sync mode
    assert "dapo_mcore/" not in "".join(line for line in proc.stderr.splitlines() if line.lstrip().startswith("File"))
    assert "another rank of the job stopped" not in proc.stderr


def test_a_refusal_on_the_trainer_reaches_the_engine_ranks_without_a_false_resume_line(reference, cli_env, tmp_path):
    """Another run's directory (a changed identity key): trainer rank 0 refuses in one line; the engine rank hears the
    refusal and stops quietly instead of saying "another rank of the job stopped ... run the same command: the run
    resumes"."""
    import shutil

    run = tmp_path / "other"
    shutil.copytree(reference, run)
    proc = _train(run, cli_env, 3, 2, "train.seed=7")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "dapo-mcore:" in line]
    assert len(lines) == 1 and "holds another run" in lines[0], proc.stderr[-3000:]
    assert "run the same command" not in proc.stderr and "another rank of the job stopped" not in proc.stderr
