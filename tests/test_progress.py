"""The live progress line (steps/s, ETA) and the end-of-run summary."""

from __future__ import annotations

import json
import logging

import pytest

from dapo_mcore.telemetry import keys, progress
from dapo_mcore.telemetry.progress import ProgressLine, format_seconds, run_summary

pytestmark = pytest.mark.unit


def test_format_seconds():
    assert [format_seconds(s) for s in (4.24, 75, 3725, float("nan"))] == ["4.2s", "1m15s", "1h02m", "?"]


def test_rate_and_eta_ignore_setup_time(monkeypatch):
    clock = iter([1000.0, 1002.0, 1004.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    line = ProgressLine(total=10, live=False)
    rate, eta = line.update(1, step_seconds=2.0)    # step 1 took 2 s; the clock starts at its beginning
    assert rate == pytest.approx(0.5) and eta == pytest.approx(18.0)
    line.update(2, step_seconds=2.0)
    rate, eta = line.update(3, step_seconds=2.0)
    assert rate == pytest.approx(0.5) and eta == pytest.approx(14.0)


def test_resumed_run_counts_only_its_own_steps(monkeypatch):
    clock = iter([50.0, 51.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    line = ProgressLine(total=100, live=False)
    line.update(41, step_seconds=1.0)
    rate, eta = line.update(42, step_seconds=1.0)
    assert rate == pytest.approx(1.0) and eta == pytest.approx(58.0)


def test_run_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_MCORE_COMMAND", "dapo-mcore")
    total = {keys.cost_key("tokens_generated", True): 1000, keys.cost_key("tokens_generated_kept", True): 250,
             keys.cost_key("tokens_generated_rejected", True): 750, keys.cost_seconds_key("step", True): 100.0,
             keys.cost_seconds_key("generate", True): 50.0, keys.cost_seconds_key("train", True): 30.0,
             keys.cost_seconds_key("checkpoint", True): 0.1}
    lines = [{keys.STEP: 0, keys.EVAL_AVG_AT_K: 0.25, keys.EVAL_K: 4}]
    lines += [{keys.STEP: s, keys.TRAIN_LR: 1e-3, keys.TRAIN_LOSS: 0.0} for s in (1, 2)]
    lines.append({keys.STEP: 3, keys.TRAIN_LR: 1e-3, keys.EVAL_AVG_AT_K: 0.75, keys.EVAL_K: 4, **total})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = run_summary(tmp_path, process_seconds=130.0).splitlines()
    assert text[0] == "run finished: 3 steps (1-3), 1m40s of step time (the steps alone, every process of the run)"
    assert text[1].startswith("this process: 2m10s of wall time from its start (every step; imports, model building, "
                              "the base model's pre-training")
    assert text[2] == "held-out avg@4: 0.250 (step 0) -> 0.750 (step 3)"
    assert text[3] == "generated tokens: 1,000 = kept for training 250 (25%) + rejected by dynamic sampling 750 (75%)"
    assert text[4] == "step time by phase: generate 50%, train 30%, other 20%"   # checkpoint (0.1%): noise
    assert text[5] == f"run dir: {tmp_path}"
    assert text[6].startswith(f"next: dapo-mcore report {tmp_path}  |  dapo-mcore diagnose {tmp_path}")
    resumed = run_summary(tmp_path, process_seconds=50.0, first_step_here=3).splitlines()[1]
    assert resumed.startswith("this process: 50.0s of wall time from its start (steps 3-3; steps 1-2 ran before "
                              "the resume;")


def test_process_age_counts_from_the_process_start():
    import time

    import psutil

    from dapo_mcore.telemetry.progress import process_age

    assert abs(process_age() - (time.time() - psutil.Process().create_time())) < 5.0
    assert process_age() > 0.5  # this test process imported pytest and torch before: all counted


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Bar:
    live = True

    def __init__(self) -> None:
        self.shown: list[str] = []

    def note(self, info: str) -> None:
        self.shown.append(info)


def _groups(accs: list[list[bool]], length: int = 5):
    from dapo_mcore.algo.dynamic_sampling import Group

    return [Group(acc=a, payload=None, response_lengths=[length] * len(a)) for a in accs]


def test_step_progress_lines_are_rate_bounded_in_logs(caplog):
    from dapo_mcore.telemetry.progress import StepProgress

    clock = _Clock()
    watch = StepProgress(target=4, max_batches=3, every_s=30.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="dapo_mcore.telemetry.progress"):
        watch.begin(7)
        watch.phase("generate")
        watch.batch(0, _groups([[True, False], [True, True], [False, True]]))  # 2 usable, 30 s not yet passed
        clock.now = 31.0
        watch.phase("generate")  # 31 s into the step: one line, batch 2 being generated
        watch.batch(1, _groups([[True, False]] * 3))  # at once after: no second line
        clock.now = 62.0
        watch.phase("train")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step 7: generate, batch 2/3, usable groups 2/4, 30 tokens generated",
                     "step 7: train, batch 2/3, usable groups 4/4, 60 tokens generated"]


def test_step_progress_goes_to_the_live_bar_every_time(caplog):
    from dapo_mcore.telemetry.progress import StepProgress

    bar = _Bar()
    watch = StepProgress(target=2, max_batches=0, every_s=30.0, bar=lambda: bar, clock=_Clock())
    with caplog.at_level(logging.INFO, logger="dapo_mcore.telemetry.progress"):
        watch.begin(1)
        watch.phase("generate")
        watch.batch(0, _groups([[True, False]]))
    assert bar.shown[-1] == "step 1: generate, batch 1, usable groups 1/2, 10 tokens generated"
    assert not caplog.records
