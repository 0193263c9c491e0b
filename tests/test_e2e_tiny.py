"""End-to-end: the tiny DAPO default through the real CLI (Megatron actor on gloo, transformers engine).

One shared base-model cache per test session (the tiny base is pre-trained once, ~30-90 s). Each run is a real
subprocess of ``python -m dapo_mcore.cli``; assertions read the artifacts a user would read.
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

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(__file__).parent / "data" / "tiny_trace.json"
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> dict[str, str]:
    e = dict(os.environ)
    # The same per-session cache as the Slurm and nemo-run tests: the tiny base is pre-trained once per session.
    e["DAPO_MCORE_CACHE"] = os.environ.get("DAPO_MCORE_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "dapo-mcore-cache")
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


def _cmd(run_dir: Path, *overrides: str, config: Path = CONFIG) -> list[str]:
    return [sys.executable, "-m", "dapo_mcore.cli", "train", str(config), f"run.dir={run_dir}", *overrides]


def _run(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r}


SHORT = ("train.steps=8", "eval.every=4", "checkpoint.every=2")


@pytest.fixture(scope="session")
def straight_run(env, tmp_path_factory) -> Path:
    """8 uninterrupted steps: the reference trajectory for the resume and trace tests."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    proc = _run(_cmd(run_dir, *SHORT), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_tiny_run_learns_and_writes_every_artifact(env, tmp_path):
    run_dir = tmp_path / "learn"
    proc = _run(_cmd(run_dir, "train.steps=30", "eval.every=10", "checkpoint.every=10"), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _metrics(run_dir)
    held = _by_step(rows, "eval/avg_at_k")
    assert set(held) == {0, 10, 20, 30}
    # Held-out accuracy starts near chance (4 rules, one right) and rises by a clear margin.
    assert held[0] < 0.4
    assert held[30] >= held[0] + 0.25, held
    acc = _by_step(rows, "rollout/acc_mean")
    assert sum(acc[s] for s in range(26, 31)) / 5 > sum(acc[s] for s in range(1, 6)) / 5 + 0.15
    # Dynamic sampling and cost accounting are visible.
    usable = _by_step(rows, "rollout/usable_group_frac")
    assert 0.5 < usable[1] <= 1.0
    assert all(r["cost/total/rollouts_generated"] >= r["cost/total/rollouts_kept"] for r in rows if r["step"] > 0)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == list(range(1, 31))

    from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, RolloutReader

    reader = RolloutReader(run_dir / ROLLOUTS_DIR)
    assert reader.steps() == list(range(1, 31))
    first = reader.read_step(1)
    assert len(first) == rows[1]["sampling/rollouts_generated"]
    assert sum(r.kept for r in first) == rows[1]["sampling/rollouts_kept"]

    assert len((run_dir / "ledger.jsonl").read_text().splitlines()) == 30
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000030"
    assert (run_dir / "config.yaml").is_file()

    rep = _run([sys.executable, "-m", "dapo_mcore.cli", "report", str(run_dir)], env)
    assert rep.returncode == 0, rep.stderr[-2000:]
    pngs = list((run_dir / "figures").glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    out = _run([sys.executable, "-m", "dapo_mcore.cli", "rollouts", str(run_dir), "--step", "2", "--limit", "3"], env)
    assert out.returncode == 0 and "Answer:" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    prof = _run([sys.executable, "-m", "dapo_mcore.cli", "profile", str(run_dir)], env)
    assert prof.returncode == 0 and "generate" in prof.stdout
    # The trained checkpoint exports to a Hugging Face model with the run's tokenizer, loadable by transformers.
    hf_out = run_dir.parent / "exported_hf"
    conv = _run([sys.executable, "-m", "dapo_mcore.cli", "convert", "mcore-to-hf", "--mcore",
                 str(run_dir / "checkpoints" / "step_000030"), "--out", str(hf_out), "--no-progress"], env)
    assert conv.returncode == 0, conv.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    from dapo_mcore.data.tokenizer import load_tokenizer

    assert AutoModelForCausalLM.from_pretrained(str(hf_out)).config.num_hidden_layers == 2
    assert load_tokenizer(hf_out).decode(load_tokenizer(hf_out)("Answer: 7").input_ids) == "Answer: 7"
    ev = _run([sys.executable, "-m", "dapo_mcore.cli", "eval", str(CONFIG), f"run.dir={run_dir}"], env)
    assert ev.returncode == 0, ev.stderr[-2000:]
    scores = dict(line.split(": ") for line in ev.stdout.splitlines() if line.startswith("eval/"))
    assert float(scores["eval/avg_at_k"]) >= held[0] + 0.25


def test_signal_checkpoints_and_resume_continues_the_same_trajectory(env, straight_run, tmp_path):
    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(_cmd(run_dir, *SHORT), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and sum(1 for _ in metrics.open()) >= 4:  # base eval + 3 steps
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, err[-3000:]
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 3 <= stopped_at < 8
    resumed = _run(_cmd(run_dir, *SHORT), env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "loaded checkpoint" in resumed.stderr
    a, b = _metrics(straight_run), _metrics(run_dir)
    assert [r["step"] for r in b] == list(range(0, 9)), "every step logged exactly once"
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rollout/acc_mean", "eval/avg_at_k"):
        assert _by_step(a, key) == _by_step(b, key), key


TRACE_KEYS = ("train/loss", "train/grad_norm", "train/entropy", "rollout/reward_mean", "rollout/acc_mean",
              "rollout/usable_group_frac", "eval/avg_at_k")


def test_stored_trace_is_reproduced(straight_run):
    """The fixed-seed short run must reproduce the stored per-step trace. After an intended change of the
    numerics, regenerate it with DAPO_MCORE_WRITE_TRACE=1 and say why in the commit."""
    rows = _metrics(straight_run)
    if os.environ.get("DAPO_MCORE_WRITE_TRACE") == "1":
        TRACE.parent.mkdir(exist_ok=True)
        data = {"config": str(CONFIG.relative_to(ROOT)), "overrides": list(SHORT),
                "metrics": {k: {str(s): v for s, v in _by_step(rows, k).items()} for k in TRACE_KEYS}}
        TRACE.write_text(json.dumps(data, indent=1) + "\n")
    trace = json.loads(TRACE.read_text())
    assert set(trace["metrics"]) == set(TRACE_KEYS)
    for key, expected in trace["metrics"].items():
        got = _by_step(rows, key)
        for step, value in expected.items():
            assert got[int(step)] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, step)


def test_ctrl_c_abandons_the_step_and_keeps_the_last_checkpoint(env, tmp_path):
    run_dir = tmp_path / "ctrlc"
    proc = subprocess.Popen(_cmd(run_dir, "train.steps=200", "checkpoint.every=2", "eval.every=0"), env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.time() + 600
    while time.time() < deadline and not latest.is_file():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "last good checkpoint is kept" in err
    from dapo_mcore.actor.checkpoint import find_latest

    assert find_latest(run_dir / "checkpoints") is not None
    assert not list((run_dir / "checkpoints").glob("*.partial"))


def test_bad_dataset_path_fails_before_anything_is_written(env, tmp_path):
    run_dir = tmp_path / "bad"
    proc = _run(_cmd(run_dir, "data.train=/nonexistent/train.parquet"), env, timeout=300)
    assert proc.returncode == 2
    assert "/nonexistent/train.parquet" in proc.stderr
    assert not run_dir.exists()


def test_run_dir_of_another_run_is_refused(env, straight_run):
    proc = _run(_cmd(straight_run, *SHORT, "algo.clip_high=0.2"), env, timeout=300)
    assert proc.returncode == 2
    assert "holds another run" in proc.stderr and "algo" in proc.stderr


def test_grpo_baseline_config_is_valid():
    from dapo_mcore.config import load_config

    cfg = load_config(ROOT / "examples" / "tiny_cpu_grpo.yaml")
    cfg.validate(1)
    assert cfg.algo.clip_high == cfg.algo.clip_low == 0.2
    assert cfg.algo.loss_agg == "seq-mean-token-mean"
    assert not cfg.algo.dynamic_sampling and not cfg.algo.overlong_shaping
    dapo = load_config(CONFIG)
    assert (cfg.train, cfg.optim, cfg.tiny_base) == (dapo.train, dapo.optim, dapo.tiny_base), "same budget"
    assert (cfg.rollout.n, cfg.rollout.max_new_tokens) == (dapo.rollout.n, dapo.rollout.max_new_tokens)
    assert cfg.rollout.gen_batch_prompts == cfg.train.prompts_per_step, "GRPO generates exactly one training batch"


def test_offload_between_phases_keeps_the_trajectory(env, straight_run, tmp_path):
    """Megatron's RL offload hooks (grad buffers + optimizer state to CPU while the engine generates) run on
    CPU too (storage freed and restored): the trajectory must be unchanged."""
    run_dir = tmp_path / "offload"
    proc = _run(_cmd(run_dir, *SHORT, "parallel.offload_for_rollout=true"), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _metrics(straight_run), _metrics(run_dir)
    for key in ("train/loss", "train/grad_norm", "rollout/acc_mean"):
        assert _by_step(a, key) == _by_step(b, key), key


def test_signal_during_dynamic_sampling_refill_resumes_the_same_trajectory(env, tmp_path):
    """With one prompt per generation batch a step draws >= 16 batches, so a signal most likely lands while
    dynamic sampling refills: the step is abandoned (its prompts come again) or, if it lands later, finished.
    Either way the resumed run must follow the uninterrupted one exactly."""
    many = ("train.steps=4", "eval.every=0", "checkpoint.every=0", "rollout.gen_batch_prompts=1",
            "algo.max_gen_batches=0")
    straight = tmp_path / "straight"
    assert _run(_cmd(straight, *many), env).returncode == 0
    run_dir = tmp_path / "preempted"
    proc = subprocess.Popen(_cmd(run_dir, *many), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and sum(1 for _ in metrics.open()) >= 2:  # base eval + step 1
            time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, err[-3000:]
    resumed = _run(_cmd(run_dir, *many), env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _metrics(straight), _metrics(run_dir)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for key in ("train/loss", "rollout/acc_mean", "rollout/gen_batches"):
        assert _by_step(a, key) == _by_step(b, key), key
