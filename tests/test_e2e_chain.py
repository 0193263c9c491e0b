"""End-to-end: DAPO on the variable-length ``sumchain`` task (examples/tiny_cpu_chain.yaml) learns, and its
responses vary in length with truncations at the start (what overlong shaping and token-level loss act on).

The chain base is pre-trained once per test session into the session's cache (shared with test_e2e_tiny's
``DAPO_MCORE_CACHE`` when ``DAPO_MCORE_TEST_CACHE`` is set): ~105 s once on an idle core, then ~28 s for the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_cpu_chain.yaml"
TIMEOUT = 3600  # bounds a hang only; never judges speed


def test_chain_run_learns_with_variable_lengths_and_truncation(cli_env, tmp_path):
    run_dir = tmp_path / "chain"
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", "train", str(CONFIG), f"run.dir={run_dir}",
                           "train.steps=10", "eval.every=10", "checkpoint.every=0"],
                          env=cli_env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    held = {r["step"]: r["eval/avg_at_k"] for r in rows if "eval/avg_at_k" in r}
    assert set(held) == {0, 10}
    assert held[10] >= held[0] + 0.1, held  # observed 0.232 -> 0.460
    first = next(r for r in rows if r["step"] == 1)
    # The untrained policy: mixed groups, short and long responses, some cut at rollout.max_new_tokens (40).
    assert 0.0 < first["rollout/usable_group_frac"] < 1.0
    assert first["rollout/resp_len_min"] <= 12 and first["rollout/resp_len_max"] == 40
    assert first["rollout/truncated_frac"] > 0.0
