"""diagnose and report know LoRA: adapters that barely move read as a learning-rate or rank problem."""

from __future__ import annotations

import json

import pytest

from dapo_mcore.telemetry.diagnose import diagnose, read_run

pytestmark = pytest.mark.unit


def _run(tmp_path, rel: float, steps: int = 8):
    lines = [{"step": s, "train/loss": 0.01, "rollout/usable_group_frac": 0.6, "lora/update_norm": rel * 2.0,
              "lora/adapter_norm": 2.0} for s in range(1, steps + 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "config.yaml").write_text("model:\n  lora:\n    rank: 8\n    alpha: 16\noptim:\n  lr: 1.0e-6\n")
    return diagnose(read_run(tmp_path))


def test_a_still_adapter_reads_as_a_learning_rate_or_rank_problem(tmp_path):
    d = _run(tmp_path, rel=1e-6)
    (f,) = [f for f in d.findings if f.rule == "lora-update"]
    assert f.level == "warn" and "barely move" in f.message
    assert "optim.lr=1e-06" in f.advice and "model.lora.alpha=16" in f.advice and "not a stall of the data" in f.advice


def test_a_moving_adapter_is_fine(tmp_path):
    d = _run(tmp_path, rel=1e-2)
    assert not [f for f in d.findings if f.rule == "lora-update"] and "lora-update" in d.ok


def test_a_full_fine_tuning_run_is_not_told_about_lora(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 0.1}) + "\n")
    d = diagnose(read_run(tmp_path))
    assert "lora-update" not in d.skipped and "lora-update" not in d.ok


def test_report_draws_the_adapter_norms(tmp_path):
    pytest.importorskip("matplotlib")
    from dapo_mcore.telemetry.report import write_report

    _run(tmp_path, rel=1e-3)
    assert any(p.name.startswith("lora") for p in write_report(tmp_path))
