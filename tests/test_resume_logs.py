"""Resume after a crash between writing a step's logs and its checkpoint: every per-step log (metrics.jsonl,
TensorBoard, ledger.jsonl, the rollout store) is cut back to the checkpoint's step at once, the same way."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dapo_mcore.config import TelemetryConfig
from dapo_mcore.run.restore import open_telemetry
from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.jsonl import read_jsonl
from dapo_mcore.telemetry.ledger import LEDGER_FILE, CostLedger
from dapo_mcore.telemetry.metrics import METRICS_FILE, TENSORBOARD_DIR, MetricsWriter
from dapo_mcore.telemetry.rollout_store import ROLLOUTS_DIR, Rollout, RolloutReader, RolloutStore

pytestmark = pytest.mark.unit

CHECKPOINT_STEP = 5
LOGGED_STEPS = 7  # steps 6 and 7 were logged, then the run died before their checkpoint


def _rollout() -> Rollout:
    return Rollout(prompt_ids=np.arange(3), response_ids=np.arange(2), logprobs=np.zeros(2, dtype=np.float32),
                   reward=1.0, acc=True, finish_reason="stop", kept=True, group_id=0, gen_batch=0)


def _crashed_run(run_dir: Path) -> dict:
    """Log steps 0..7 as the trainer does (metrics, ledger, rollouts); return the ledger state of the checkpoint
    at step 5. Nothing is closed: the process 'died'."""
    writer = MetricsWriter(run_dir)
    ledger = CostLedger(run_dir)
    store = RolloutStore(run_dir / ROLLOUTS_DIR)
    writer.log(0, {"eval/avg_at_k": 0.25})
    checkpoint_state = None
    for step in range(1, LOGGED_STEPS + 1):
        ledger.record_step(step, prompts_generated=2, prompts_kept=1, rollouts_generated=4, rollouts_kept=2,
                           tokens_generated=8, tokens_generated_kept=4, tokens_trained=6,
                           phase_seconds={keys.STEP_PHASE: 1.0}, num_devices=1)
        writer.log(step, {keys.TRAIN_LOSS: 0.1 * step})
        store.append_step(step, [_rollout()])
        if step == CHECKPOINT_STEP:
            checkpoint_state = {"step": step, "ledger": ledger.state_dict()}
    writer._tb.flush()
    return checkpoint_state


def _tensorboard_steps(run_dir: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    acc.Reload()
    return [e.step for e in acc.Scalars(keys.TRAIN_LOSS)]


def _resume(run_dir: Path, state: dict, rollout_store: bool) -> SimpleNamespace:
    cfg = SimpleNamespace(run=SimpleNamespace(dir=str(run_dir), rollout_store=rollout_store),
                          telemetry=TelemetryConfig())  # W&B off, as by default
    parts = SimpleNamespace(cfg=cfg, is_main=True, _resume_state=state, _closers=[], model_files=(None, None),
                            tokenizer=SimpleNamespace(save_pretrained=lambda path: Path(path).mkdir(parents=True)))
    open_telemetry(parts, state["step"])
    return parts


@pytest.mark.parametrize("rollout_store", [True, False])
def test_every_step_log_is_cut_back_to_the_checkpoint_when_the_run_resumes(tmp_path, rollout_store, monkeypatch):
    state = _crashed_run(tmp_path)
    assert [r["step"] for r in read_jsonl(tmp_path / LEDGER_FILE)] == list(range(1, LOGGED_STEPS + 1))
    # TensorBoard reads event files in name order: events.out.tfevents.<seconds>.<host>.<pid>.<uid>. A real resume
    # is a later process (a later name); here both writers share one process and maybe one second, where uid 10
    # sorts before uid 9 once a suite has opened ten writers. Date the resumed writer's file as a later start would.
    import tensorboard.summary.writer.event_file_writer as event_file_writer

    later = SimpleNamespace(time=lambda: time.time() + 10)
    monkeypatch.setattr(event_file_writer, "time", later)
    parts = _resume(tmp_path, state, rollout_store)
    monkeypatch.undo()
    # Right after the resume, before the resumed run writes anything (it may die again before its first step).
    kept = list(range(1, CHECKPOINT_STEP + 1))
    assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [0, *kept]
    assert [r["step"] for r in read_jsonl(tmp_path / LEDGER_FILE)] == kept
    assert RolloutReader(tmp_path / ROLLOUTS_DIR).steps() == kept  # also when the resumed run stores no rollouts
    assert _tensorboard_steps(tmp_path) == kept
    # The resumed run continues each log from the checkpoint's step, once.
    parts.ledger.record_step(6, prompts_generated=2, prompts_kept=1, rollouts_generated=4, rollouts_kept=2,
                             tokens_generated=8, tokens_generated_kept=4, tokens_trained=6,
                             phase_seconds={keys.STEP_PHASE: 1.0}, num_devices=1)
    parts.writer.log(6, {keys.TRAIN_LOSS: 9.0})
    if parts.store is not None:
        parts.store.append_step(6, [_rollout()])
    for close in parts._closers:
        close()
    assert [r["step"] for r in read_jsonl(tmp_path / LEDGER_FILE)] == [*kept, 6]
    assert read_jsonl(tmp_path / LEDGER_FILE)[-1]["cost/total/rollouts_generated"] == 4 * 6
    assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [0, *kept, 6]
    assert RolloutReader(tmp_path / ROLLOUTS_DIR).steps() == (kept + [6] if rollout_store else kept)
    assert _tensorboard_steps(tmp_path) == [*kept, 6]


def test_a_ledger_reopened_after_close_appends_and_never_cuts_again(tmp_path):
    state = _crashed_run(tmp_path)
    ledger = CostLedger(tmp_path)
    ledger.load_state_dict(state["ledger"])
    ledger.close()
    ledger.record_step(6, prompts_generated=1, prompts_kept=1, rollouts_generated=2, rollouts_kept=2,
                       tokens_generated=2, tokens_generated_kept=2, tokens_trained=2,
                       phase_seconds={keys.STEP_PHASE: 1.0}, num_devices=1)
    ledger.close()
    assert [r["step"] for r in read_jsonl(tmp_path / LEDGER_FILE)] == [1, 2, 3, 4, 5, 6]
