"""Rollout routing replay on several processes: EP=2 (so DP=2) in the synchronous loop, killed with -9 after a
checkpoint and resumed, and the async mode with two engine ranks and two trainer ranks. Each step's routing mismatch
is 0: every trainer rank replays the engine's experts for exactly the samples it trains on. Before the routes
travelled between ranks, both runs stopped at step 1 with "a rollout carries no routed experts" on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMON = ("model.tiny_base=false", "eval.every=0", "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=1",
          "algo.router_replay=rollout", "parallel.expert_parallel=2")


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory) -> Path:
    from conversion.synthetic_moe import save_tiny_moe_base

    return save_tiny_moe_base(tmp_path_factory.mktemp("moe") / "base", steps=120)


def _train(env: dict, run: Path, base: Path, nproc: int, *extra: str, fault: str | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "dapo_mcore.cli",
           "train", "examples/tiny_cpu.yaml", f"model.hf_path={base}", f"run.dir={run}", *COMMON, *extra]
    full = dict(env, DAPO_MCORE_STRICT_DEVICE="1", **({"DAPO_MCORE_FAULT": fault} if fault else {}))
    return subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=1800)


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows}


def _replayed(rows: dict[int, dict], steps: list[int], same_policy: tuple[int, ...] | None = None) -> None:
    """Every step replays the engine's experts; the log-probs of the steps whose batch the same policy sampled
    (all in the synchronous loop; async: the first, the later ones lag one version) equal the engine's."""
    assert sorted(rows) == steps
    for step, r in rows.items():
        assert r["moe/routing_mismatch_frac"] == 0.0, r
        if same_policy is None or step in same_policy:
            assert r["mismatch/logp_abs_diff_max"] < 1e-4, r


@pytest.mark.e2e
def test_replay_at_ep2_trains_resumes_after_kill9_and_never_mismatches(moe_base, cli_env, tmp_path):
    run = tmp_path / "run"
    killed = _train(cli_env, run, moe_base, 2, "train.steps=3", fault="saved:1@1")
    assert killed.returncode != 0 and "killing this process (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert "carries no routed experts" not in killed.stderr
    _replayed(_rows(run), [1])
    resumed = _train(cli_env, run, moe_base, 2, "train.steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_000001 (step 1)" in resumed.stderr, resumed.stderr[-3000:]
    _replayed(_rows(run), [1, 2, 3])


@pytest.mark.e2e
def test_replay_in_async_mode_with_two_engine_ranks(moe_base, cli_env, tmp_path):
    """2 engine ranks generate (routes travel to trainer rank 0 on the wire), 2 trainer ranks at EP=2 train (each
    fetches its samples' routes from trainer rank 0)."""
    run = tmp_path / "async"
    proc = _train(cli_env, run, moe_base, 4, "train.steps=2", "rollout.pipeline.mode=async",
                  "rollout.pipeline.engine_ranks=2", "algo.tis_cap=2.0", "rollout.pipeline.bucket_mb=0.02")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _replayed(_rows(run), [1, 2], same_policy=(1,))
