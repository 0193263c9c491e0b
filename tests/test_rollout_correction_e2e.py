"""A tiny run in bypass mode with Geo-RS rejection: it completes, its profile shows no old-log-prob phase, and the
correction's metrics are logged (every other preset: benchmarks/bypass.py --all-presets, in docs/results.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def test_bypass_run_skips_the_old_logprob_phase(cli_env, tmp_path):
    run_dir = tmp_path / "bypass"
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "train", str(ROOT / "examples" / "tiny_cpu.yaml"),
                           f"run.dir={run_dir}", "train.steps=2", "eval.every=0", "eval.at_start=false",
                           "checkpoint.every=0", "algo.rollout_correction.preset=bypass_ppo_clip_geo_rs"],
                          env=cli_env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trained = [r for r in rows if "time/train" in r]
    assert len(trained) == 2 and not any("time/old_logprobs" in r for r in rows)
    assert all(r["rollout_corr/bypass"] == 1.0 and "rollout_corr/kl_k3" in r for r in trained)
    # the first update's pi_theta is the engine's policy: Geo-RS keeps its responses, so something trained
    assert trained[0]["train/updates"] >= 1 and trained[0]["rollout_corr/rejected_token_frac"] < 1.0
    prof = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "profile", str(run_dir)], env=cli_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert prof.returncode == 0, prof.stderr[-2000:]
    assert "old_logprobs: skipped (bypass mode" in " ".join(prof.stdout.split())
