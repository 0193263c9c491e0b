"""Streaming and partial rollouts over two engine groups in a real run: two gloo ranks, each its own
transformers engine, stream every step together, buffer the groups in flight at the fill, continue them next step,
and a run stopped with a non-empty buffer resumes exactly the uninterrupted trajectory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 3600  # bounds a hang only; ~30 s a run on 2 idle cores
OVERRIDES = ("eval.every=0", "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=0", "rollout.schedule.streaming=true",
             "rollout.schedule.stream_chunk_prompts=16", "rollout.schedule.partial=true", "algo.tis_cap=2.0",
             "rollout.schedule.exchange_every=2", "train.prompts_per_step=4")


def _train(run_dir: Path, steps: int, env: dict[str, str], order: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "dapo_mcore.cli", "train",
           str(ROOT / "examples" / "tiny_cpu.yaml"), f"run.dir={run_dir}", f"train.steps={steps}", *OVERRIDES,
           f"rollout.schedule.order={order}"]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)


def _by_step(run_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.parametrize("order", ["prompt", "completion"])
def test_two_engine_groups_stream_buffer_and_resume_exactly(cli_env, tmp_path, order):
    straight = tmp_path / "straight"
    proc = _train(straight, 3, cli_env, order)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chunk by chunk" not in proc.stderr, "two engine groups fell back to chunked generation"
    buffered = _by_step(straight, "sampling/tokens_partial_buffered")
    assert buffered[1] > 0, f"step 1 aborted no group in flight: {buffered}"
    resumed, stale = _by_step(straight, "sampling/groups_resumed"), _by_step(straight, "sampling/tokens_stale_kept")
    assert resumed[2] > 0 and 0 < stale[2] <= buffered[1]
    assert _by_step(straight, "partial/tokens")[2] == stale[2]
    # the staleness histogram: continued prefixes at lag 1, the rest fresh
    assert _by_step(straight, "staleness/tokens_lag_1") == stale
    fresh = _by_step(straight, "staleness/tokens_lag_0")
    assert sorted(fresh) == sorted(stale) and fresh[1] > 0  # step 1 resumes nothing: all its tokens are fresh

    stopped = tmp_path / "stopped"
    first = _train(stopped, 1, cli_env, order)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = stopped / "checkpoints" / "step_000001"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    # the buffered groups are in a binary file beside trainer_state.json, which only names it
    assert state["schedule"]["partials"] == {"file": "partials.pt", "groups": resumed[2]}
    assert (ckpt / "partials.pt").is_file()
    second = _train(stopped, 3, cli_env, order)
    assert second.returncode == 0, second.stderr[-3000:]
    for key in ("train/loss", "train/grad_norm", "rollout/acc_mean", "sampling/groups_resumed",
                "sampling/tokens_stale_kept", "sampling/tokens_generated"):
        assert _by_step(straight, key) == _by_step(stopped, key), key
