"""The tiny tool task end to end: a run with the Python tool trains, logs its tool counters and stores its turns; killed
with -9 inside a tool call, it resumes from its checkpoint and follows the uninterrupted run exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_e2e_tiny import ROOT, _by_step, _metrics, _run, env  # noqa: F401

pytestmark = pytest.mark.e2e
CONFIG = ROOT / "examples" / "tiny_cpu_tools.yaml"
# A small, quickly pre-trained base (it writes the call's format, not always the right call), one generation batch of
# two prompts a step (no dynamic sampling: no step waits for usable groups), a checkpoint after every step. The
# unboxed sandbox: what is tested is the resume, not the box (tests/test_tools_*.py test the box).
FAST = ("tiny_base.steps=150", "train.steps=2", "train.prompts_per_step=2", "train.mini_batch_prompts=2",
        "rollout.gen_batch_prompts=2", "rollout.n=4", "algo.dynamic_sampling=false", "eval.every=0",
        "eval.at_start=false", "eval.max_prompts=8", "checkpoint.every=1", "rollout.tools.sandbox=none",
        "rollout.tools.pool_size=2")
KEYS = ("train/loss", "train/grad_norm", "train/entropy", "rollout/reward_mean", "rollout/acc_mean",
        "rollout/resp_len_mean", "tools/calls_per_response", "cost/step/tool_calls", "cost/step/tool_errors")


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "dapo_mcore.cli", "train", str(CONFIG), f"run.dir={run_dir}", *FAST, *extra]


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory) -> Path:  # noqa: F811
    run_dir = tmp_path_factory.mktemp("tools") / "straight"
    proc = _run(_cmd(run_dir), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_a_tool_run_logs_its_calls_and_stores_its_turns(straight):
    rows = _metrics(straight)
    calls = _by_step(rows, "cost/step/tool_calls")
    assert sorted(calls) == [1, 2] and sum(calls.values()) > 0
    assert all(r["tools/calls_per_response"] * 8 == r["cost/step/tool_calls"] for r in rows if "tools/calls_per_response" in r)
    from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, RolloutReader

    stored = [r for s in (1, 2) for r in RolloutReader(straight / ROLLOUTS_DIR).read_step(s)]
    called = [r for r in stored if r.tool_calls]
    assert called and all(not r.loss_mask.all() for r in called)
    assert all(np.isnan(r.logprobs[~r.loss_mask]).all() and not np.isnan(r.logprobs[r.loss_mask]).any()
               for r in called)
    assert sum(r.tool_calls for r in stored) == sum(calls.values())


def test_killed_inside_a_tool_call_the_run_resumes_exactly(straight, env, tmp_path):  # noqa: F811
    ledger = [json.loads(x) for x in (straight / "ledger.jsonl").read_text().splitlines() if x.strip()]
    before = int(next(r for r in ledger if r["step"] == 1)["cost/total/tool_calls"])
    run_dir = tmp_path / "killed"
    killed = _run(_cmd(run_dir), dict(env, DAPO_MCORE_FAULT=f"tool:{before + 1}"))  # step 2's first call
    assert killed.returncode != 0 and "killing this process (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith("1")
    resumed = _run(_cmd(run_dir), env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _metrics(straight), _metrics(run_dir)
    assert [r["step"] for r in b] == [1, 2], "every step logged exactly once"
    for key in KEYS:
        assert _by_step(a, key) == _by_step(b, key), key
