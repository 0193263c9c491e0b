"""The tiny DAPO job on one GPU for a few steps: NCCL backend, actor on CUDA, finite losses, a checkpoint.

Runs ``python -m dapo_mcore.cli train examples/tiny_cpu.yaml`` in a child process (its own process group).
Skipped without CUDA; ``DAPO_MCORE_GPU_TESTS_ON_CPU=1`` runs it on the CPU (gloo) to check the test's logic.
The tiny base model comes from ``$DAPO_MCORE_CACHE`` (benchmarks/gpu_check.sh points it at the carried cache);
without a cached base the child pre-trains one first, which takes minutes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import summarize_tiny_run
from benchmarks.gpu_measure import free_port

ON_CPU = os.environ.get("DAPO_MCORE_GPU_TESTS_ON_CPU") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs CUDA (or DAPO_MCORE_GPU_TESTS_ON_CPU=1)"),
]

REPO = Path(__file__).resolve().parents[1]
STEPS = 3


def test_tiny_dapo_run_on_the_gpu(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dapo_mcore.cli", "train", "examples/tiny_cpu.yaml", f"train.steps={STEPS}",
           f"run.dir={run_dir}", "eval.every=0", "eval.at_start=false", "checkpoint.every=0"]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = tmp_path / "train.log"
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = summarize_tiny_run(run_dir, log)
    assert summary["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
    assert summary["steps_done"] == STEPS
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for r in train_rows:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) and r["train/updates"] >= 1
        # actor (Megatron) and engine (HF) log-probs of the same tokens agree: the weights synced every step
        assert r["mismatch/logp_abs_diff_mean"] < 1e-3, r["mismatch/logp_abs_diff_mean"]
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "COMPLETE").is_file()
