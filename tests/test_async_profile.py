"""The async profile in a real async run (1 trainer rank + 1 engine rank, the tiny base): every second attributed once.

The engines are made the bottleneck (generation batches of 1024 prompts against a 16-prompt training step), so the
trainer waits for them every step inside its weight publish: that wait must be charged to ``wait_rollouts``, not to
``sync_weights``; ``profile``'s rows, the summary line and ``pipeline.png``'s trainer lane add up to the step time;
the step line shows lag and waits; and the run's own ``next:`` eval command works on its checkpoint.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_mcore.telemetry import keys, lanes, profile, report
from dapo_mcore.telemetry.progress import run_summary
from dapo_mcore.telemetry.report import load_run

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
SLOW_ENGINES = ("rollout.pipeline.mode=async", "algo.tis_cap=2.0", "rollout.gen_batch_prompts=1024",
                "eval.at_start=false", "eval.every=0", "checkpoint.every=0", "train.steps=3")


@pytest.fixture(scope="module")
def slow_engines(cli_env, tmp_path_factory) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("async_profile") / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                           "dapo_mcore.cli", "train", str(ROOT / "examples" / "tiny_cpu.yaml"), f"run.dir={run}",
                           *SLOW_ENGINES], env=dict(cli_env, DAPO_MCORE_STRICT_DEVICE="1"), cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout + proc.stderr


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_the_trainers_wait_is_wait_rollouts_not_sync_weights(slow_engines):
    run, _ = slow_engines
    rows = [r for r in _rows(run) if keys.TIME_STEP in r]
    assert [r[keys.STEP] for r in rows] == [1, 2, 3]
    waits = sum(r[keys.time_key("wait_rollouts")] for r in rows)
    publish = sum(r[keys.TIME_SYNC_WEIGHTS] for r in rows)
    generate = sum(r["async/engine_generate_s"] for r in rows)
    # The engines generate 64x what the trainer trains: the trainer mostly waits, and the publish is a transfer.
    assert waits > 0.5 * generate and publish < 0.5 * waits, (waits, publish, generate)
    for r in rows:
        assert r["async/trainer_wait_s"] == pytest.approx(r[keys.time_key("wait_rollouts")], abs=1e-3)
        assert r["async/trainer_wait_s"] == pytest.approx(r["async/trainer_wait_batch_s"]
                                                          + r.get("async/trainer_wait_publish_s", 0.0))
        timed = sum(v for k, v in r.items() if k.startswith("time/") and k != keys.TIME_STEP)
        assert timed <= r[keys.TIME_STEP] + 1e-6, r  # no second counted twice


def test_profile_rows_sum_to_the_step_time_with_no_wait_in_sync_weights(slow_engines):
    run, _ = slow_engines
    summary = profile.summarize(load_run(run))
    rows = {row.phase: row for row in summary.phases}
    wall = rows.pop("step (wall)").total_s
    assert sum(row.total_s for row in rows.values()) == pytest.approx(wall, rel=1e-9)
    wait, publish = rows["wait for rollouts (engines)"], rows["publish weights (transfer)"]
    assert wait.total_s > publish.total_s and rows["other (untimed)"].share < 0.1, rows
    assert "sync_weights" not in rows and {row.phase for row in summary.engine_lane} >= {
        "generate", "score", "wait for weights", "receive weights", "eval"}
    line = next(x for x in run_summary(run).splitlines() if x.startswith("step time by phase: "))
    assert "wait for rollouts (engines)" in line and "sync_weights" not in line and "other" not in line.split(
        "wait for rollouts")[0], line


def test_the_pipeline_lanes_draw_every_second_once_and_eval_on_the_engines(slow_engines, tmp_path):
    run, _ = slow_engines
    records = load_run(run)
    segments = lanes.layout(records, [1, 2, 3])
    by_step = {r[keys.STEP]: r for r in records}
    for step in (1, 2, 3):
        trainer = [s for s in segments if s.lane == "trainer" and s.step == step]
        assert sum(s.width for s in trainer) == pytest.approx(by_step[step][keys.TIME_STEP])
        assert all(a.start + a.width == pytest.approx(b.start) for a, b in zip(trainer[:-1], trainer[1:], strict=True))
    assert {s.what for s in segments if s.lane == "engines"} >= {"generate + score", "eval"}
    assert "eval" not in {s.what for s in segments if s.lane == "trainer"}  # the trainer's lane shows its wait
    assert report.pipeline_figure(records, tmp_path, lanes.select_steps(records, "2-3")) == tmp_path / "pipeline.png"
    with pytest.raises(ValueError, match=r"among the run's async steps \(1-3\)"):
        lanes.select_steps(records, "7-9")


def test_the_step_line_shows_lag_and_waits(slow_engines):
    _, log = slow_engines
    lines = [x for x in log.splitlines() if " step 3/3 " in x]
    assert lines and "lag=1.00/1 wait_rollouts=" in lines[0] and "engines_wait=" in lines[0], lines


def test_the_next_line_eval_command_works_on_the_async_checkpoint(slow_engines, cli_env):
    _, log = slow_engines
    nxt = next(x for x in log.splitlines() if x.startswith("next: "))
    command = shlex.split(nxt.removeprefix("next: ").split("|")[-1])
    assert Path(command[0]).name == "dapo-mcore" and command[1] == "eval", command
    proc = subprocess.run([sys.executable, "-m", "dapo_mcore.cli", *command[1:]], env=cli_env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/avg_at_k" in proc.stdout and "leaves no" not in proc.stderr
