"""MetricsWriter: metrics.jsonl and TensorBoard read back, resume truncation, rank gating; PhaseTimer."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.metrics import METRICS_FILE, TENSORBOARD_DIR, MetricsWriter, read_metrics
from dapo_mcore.telemetry.timers import PhaseTimer

pytestmark = pytest.mark.unit


def _scalars(run_dir, tag):
    acc = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _step_metrics(step):
    return {keys.TRAIN_LOSS: 1.0 / (step + 1), keys.ROLLOUT_ACC_MEAN: np.float32(0.25 * step),
            keys.TRAIN_GRAD_NORM: torch.tensor(2.0 + step), keys.ROLLOUT_GEN_BATCHES: 3}


def test_jsonl_and_tensorboard_read_back(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(4):
            writer.log(step, _step_metrics(step))
    records = read_metrics(tmp_path)
    assert [r[keys.STEP] for r in records] == [0, 1, 2, 3]
    assert records[2][keys.TRAIN_LOSS] == pytest.approx(1 / 3)
    assert records[3][keys.TRAIN_GRAD_NORM] == 5.0
    assert records[1][keys.ROLLOUT_GEN_BATCHES] == 3 and isinstance(records[1][keys.ROLLOUT_GEN_BATCHES], int)
    loss = _scalars(tmp_path, keys.TRAIN_LOSS)
    assert [s for s, _ in loss] == [0, 1, 2, 3]
    assert [v for _, v in loss] == pytest.approx([1.0, 0.5, 1 / 3, 0.25])
    assert _scalars(tmp_path, keys.ROLLOUT_ACC_MEAN)[-1] == (3, pytest.approx(0.75))


def test_each_step_is_flushed_before_close(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.log(0, {keys.TRAIN_LOSS: 3.0})
    # A killed process never reaches close(): the line must already be on disk.
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert json.loads(lines[0]) == {keys.STEP: 0, keys.TRAIN_LOSS: 3.0}
    assert _scalars(tmp_path, keys.TRAIN_LOSS) == [(0, 3.0)]
    writer.close()


def test_resume_truncates_and_purges(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(6):
            writer.log(step, {keys.TRAIN_LOSS: float(step)})
    with MetricsWriter(tmp_path, resume_step=3) as writer:
        for step in range(3, 5):
            writer.log(step, {keys.TRAIN_LOSS: 100.0 + step})
    records = read_metrics(tmp_path)
    assert [r[keys.STEP] for r in records] == [0, 1, 2, 3, 4]
    assert [r[keys.TRAIN_LOSS] for r in records] == [0.0, 1.0, 2.0, 103.0, 104.0]
    assert _scalars(tmp_path, keys.TRAIN_LOSS) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]


def test_repeated_step_without_resume_raises(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.log(0, {keys.TRAIN_LOSS: 1.0})
        writer.log(1, {keys.TRAIN_LOSS: 1.0})
    with MetricsWriter(tmp_path) as writer, pytest.raises(ValueError, match="resume_step=1"):
        writer.log(1, {keys.TRAIN_LOSS: 1.0})
    assert len(read_metrics(tmp_path)) == 2


def test_torn_last_line_is_dropped(tmp_path, caplog):
    with MetricsWriter(tmp_path) as writer:
        writer.log(0, {keys.TRAIN_LOSS: 1.0})
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 1, "train/lo')  # killed mid-write
    assert [r[keys.STEP] for r in read_metrics(tmp_path)] == [0]
    with MetricsWriter(tmp_path) as writer:
        writer.log(1, {keys.TRAIN_LOSS: 2.0})
    assert [r[keys.TRAIN_LOSS] for r in read_metrics(tmp_path)] == [1.0, 2.0]


def test_disabled_writer_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsWriter(run_dir, enabled=False) as writer:
        writer.log(0, {keys.TRAIN_LOSS: 1.0})
    assert not run_dir.exists()


def test_non_numeric_value_raises(tmp_path):
    with MetricsWriter(tmp_path) as writer, pytest.raises(ValueError, match="non-numeric"):
        writer.log(0, {keys.TRAIN_LOSS: "high"})


def test_phase_timer_accumulates_and_nests():
    timer = PhaseTimer()
    with timer.phase("step"):
        for _ in range(2):
            with timer.phase("generate"):
                time.sleep(0.02)
        with timer.phase("train"):
            time.sleep(0.01)
    seconds = timer.pop_step()
    assert set(seconds) == {"step", "generate", "train"}
    assert seconds["generate"] >= 0.04 and seconds["train"] >= 0.01
    assert seconds["step"] >= seconds["generate"] + seconds["train"]
    assert timer.pop_step() == {}
    assert PhaseTimer.as_metrics({"generate": 1.5}) == {keys.TIME_GENERATE: 1.5}


def test_phase_timer_rejects_misuse():
    timer = PhaseTimer()
    with timer.phase("train"):
        with pytest.raises(ValueError, match="already open"):
            with timer.phase("train"):
                pass
        with pytest.raises(ValueError, match="still open"):
            timer.pop_step()
    with pytest.raises(RuntimeError), timer.phase("eval"):
        raise RuntimeError("boom")
    assert "eval" in timer.pop_step()  # time is charged even when the phase raised
