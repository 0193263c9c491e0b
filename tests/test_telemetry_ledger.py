"""CostLedger: arithmetic against a naive recount, exact resume through state_dict, ledger.jsonl."""

from __future__ import annotations

import json
import random

import pytest

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.jsonl import read_jsonl
from dapo_mcore.telemetry.ledger import LEDGER_FILE, CostLedger

pytestmark = pytest.mark.unit


def _random_steps(n, seed=0):
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        pg = rng.randint(1, 50)
        rg = pg * 8
        tg = rg * rng.randint(1, 30)
        phases = {"generate": rng.uniform(0, 5), "train": rng.uniform(0, 3)}
        if rng.random() < 0.4:
            phases["eval"] = rng.uniform(0, 2)
        phases["step"] = sum(phases.values()) + rng.uniform(0, 1)
        steps.append(dict(
            prompts_generated=pg, prompts_kept=rng.randint(0, pg), rollouts_generated=rg,
            rollouts_kept=rng.randint(0, rg), tokens_generated=tg, tokens_generated_kept=rng.randint(0, tg),
            tokens_trained=rng.randint(0, 10 * tg), phase_seconds=phases, num_devices=rng.choice([1, 8, 16]),
        ))
    return steps


def test_step_and_cumulative_arithmetic(tmp_path):
    ledger = CostLedger(tmp_path)
    steps = _random_steps(7)
    for i, s in enumerate(steps):
        metrics = ledger.record_step(i, **s)
    last = steps[-1]
    step_key = lambda n: keys.cost_key(n, cumulative=False)  # noqa: E731
    total_key = lambda n: keys.cost_key(n, cumulative=True)  # noqa: E731
    assert metrics[step_key("prompts_rejected")] == last["prompts_generated"] - last["prompts_kept"]
    assert metrics[step_key("tokens_generated_rejected")] == last["tokens_generated"] - last["tokens_generated_kept"]
    assert metrics[step_key("device_seconds")] == pytest.approx(last["num_devices"] * last["phase_seconds"]["step"])
    # Naive recount of every total.
    for name in ("prompts_generated", "rollouts_kept", "tokens_generated", "tokens_trained"):
        assert metrics[total_key(name)] == sum(s[name] for s in steps)
    assert metrics[total_key("rollouts_rejected")] == sum(s["rollouts_generated"] - s["rollouts_kept"] for s in steps)
    device_s = sum(s["num_devices"] * s["phase_seconds"]["step"] for s in steps)
    assert metrics[total_key("device_seconds")] == pytest.approx(device_s)
    assert metrics[keys.COST_TOTAL_DEVICE_HOURS] == pytest.approx(device_s / 3600)
    eval_total = sum(s["phase_seconds"].get("eval", 0.0) for s in steps)
    assert metrics[keys.cost_seconds_key("eval", cumulative=True)] == pytest.approx(eval_total)
    lines = read_jsonl(tmp_path / LEDGER_FILE)
    assert [r[keys.STEP] for r in lines] == list(range(7))
    assert lines[-1] == pytest.approx({keys.STEP: 6, **metrics})


def test_state_round_trip_matches_uninterrupted_run(tmp_path):
    steps = _random_steps(10, seed=1)
    straight = CostLedger(tmp_path / "straight")
    for i, s in enumerate(steps):
        expected = straight.record_step(i, **s)

    first = CostLedger(tmp_path / "resumed")
    for i, s in enumerate(steps[:7]):
        first.record_step(i, **s)
        if i == 4:
            state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    first.close()  # the run died after step 6; the checkpoint holds step 4
    resumed = CostLedger(tmp_path / "resumed")
    resumed.load_state_dict(state)
    for i, s in enumerate(steps[5:], start=5):
        got = resumed.record_step(i, **s)
    assert got == pytest.approx(expected)
    lines = read_jsonl(tmp_path / "resumed" / LEDGER_FILE)
    assert [r[keys.STEP] for r in lines] == list(range(10))
    for got_line, want_line in zip(lines, read_jsonl(tmp_path / "straight" / LEDGER_FILE), strict=True):
        assert got_line == pytest.approx(want_line)


def test_validation_errors():
    ledger = CostLedger()
    good = _random_steps(1)[0]
    with pytest.raises(ValueError, match="exceeds"):
        ledger.record_step(0, **{**good, "prompts_kept": good["prompts_generated"] + 1})
    with pytest.raises(ValueError, match="timer.phase"):
        ledger.record_step(0, **{**good, "phase_seconds": {"generate": 1.0}})
    with pytest.raises(ValueError, match="non-negative"):
        ledger.record_step(0, **{**good, "tokens_trained": -1})
    ledger.record_step(3, **good)
    with pytest.raises(ValueError, match="not after"):
        ledger.record_step(3, **good)


def test_disabled_ledger_counts_but_writes_nothing(tmp_path):
    ledger = CostLedger(tmp_path / "run", enabled=False)
    metrics = ledger.record_step(0, **_random_steps(1)[0])
    assert metrics[keys.cost_key("prompts_generated", cumulative=True)] > 0
    assert not (tmp_path / "run").exists()
