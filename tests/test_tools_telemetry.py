"""Tool counters in the cost ledger (per step, totals, exact resume, the checks) and in ``profile``."""

from __future__ import annotations

import pytest

from dapo_mcore.telemetry import keys, profile, report
from dapo_mcore.telemetry.ledger import CostLedger
from dapo_mcore.telemetry.metrics import MetricsWriter

pytestmark = pytest.mark.unit

BASE = dict(prompts_generated=4, prompts_kept=2, rollouts_generated=32, rollouts_kept=16, tokens_generated=900,
            tokens_generated_kept=400, tokens_trained=1200, num_devices=1)
TOOLS = [dict(tool_calls=30, tool_errors=5, tool_timeouts=1, tool_sandbox_failures=0, tool_seconds=1.5),
         dict(tool_calls=20, tool_errors=2, tool_timeouts=0, tool_sandbox_failures=1, tool_seconds=0.5),
         dict(tool_calls=25, tool_errors=0, tool_timeouts=0, tool_sandbox_failures=0, tool_seconds=1.0)]


def _log(run_dir, steps=3):
    ledger = CostLedger(run_dir)
    with MetricsWriter(run_dir) as writer:
        for step in range(steps):
            phases = {"generate": 1.0, "train": 1.0, "step": 2.1}
            m = ledger.record_step(step + 1, **BASE, **TOOLS[step], phase_seconds=phases)
            writer.log(step + 1, {**m, **{keys.time_key(p): s for p, s in phases.items()}})
    ledger.close()
    return ledger


def test_ledger_counts_tools_and_resumes_them_exactly(tmp_path):
    ledger = _log(tmp_path)
    m = ledger.as_metrics()
    assert m[keys.cost_key("tool_calls", cumulative=False)] == 25
    for name in ("tool_calls", "tool_errors", "tool_timeouts", "tool_sandbox_failures", "tool_seconds"):
        assert m[keys.cost_key(name, cumulative=True)] == pytest.approx(sum(t[name] for t in TOOLS))
    again = CostLedger(tmp_path)
    again.load_state_dict(ledger.state_dict())
    assert again.total_counts == ledger.total_counts
    old = ledger.state_dict()
    for name in ("tool_calls", "tool_errors", "tool_timeouts", "tool_sandbox_failures", "tool_seconds"):
        del old["total_counts"][name]  # a checkpoint written before the tool counters
    fresh = CostLedger()
    fresh.load_state_dict(old)
    assert fresh.total_counts["tool_calls"] == 0


@pytest.mark.parametrize("bad", [dict(tool_calls=1, tool_errors=2), dict(tool_calls=3, tool_errors=1, tool_timeouts=2),
                                 dict(tool_seconds=-1.0)])
def test_ledger_refuses_inconsistent_tool_counts(bad):
    with pytest.raises(ValueError, match="tool_"):
        CostLedger().record_step(1, **BASE, **bad, phase_seconds={"step": 1.0})


def test_profile_shows_the_tool_table_only_when_calls_were_made(tmp_path, capsys):
    _log(tmp_path / "tools")
    summary = profile.summarize(report.load_run(tmp_path / "tools"))
    assert summary.tools["tool_calls"] == 75 and summary.tools["tool_errors"] == 7
    assert summary.tools["tool_seconds"] == pytest.approx(3.0)
    assert profile.main([str(tmp_path / "tools")]) == 0
    out = capsys.readouterr().out
    assert "Tool calls (window total)" in out and "9.3%" in out and "0.040 s/call" in out
    ledger = CostLedger(tmp_path / "plain")
    with MetricsWriter(tmp_path / "plain") as writer:
        writer.log(1, ledger.record_step(1, **BASE, phase_seconds={"step": 1.0}))
    assert profile.summarize(report.load_run(tmp_path / "plain")).tools == {}


def _tool_run(run_dir, calls, errors, timeouts, boxless):
    ledger = CostLedger(run_dir)
    with MetricsWriter(run_dir) as writer:
        for step in range(1, 9):
            m = ledger.record_step(step, **BASE, tool_calls=calls, tool_errors=errors, tool_timeouts=timeouts,
                                   tool_sandbox_failures=boxless, tool_seconds=0.1, phase_seconds={"step": 1.0})
            writer.log(step, {**m, keys.TRAIN_LOSS: 0.1})
    ledger.close()
    return run_dir


@pytest.mark.parametrize(("counts", "level", "needle"), [
    ((40, 2, 0, 0), "info", "tool error rate 5%"),
    ((40, 30, 2, 0), "warn", "most tool calls fail"),
    ((40, 30, 25, 0), "warn", "most tool calls fail"),
    ((40, 40, 0, 40), "warn", "sandbox does not start"),
])
def test_diagnose_reads_the_tool_error_rate(tmp_path, counts, level, needle):
    from dapo_mcore.telemetry import diagnose

    d = diagnose.diagnose(diagnose.read_run(_tool_run(tmp_path, *counts)))
    found = [f for f in d.findings if f.rule == "tools"]
    assert len(found) == 1 and found[0].level == level
    assert needle in found[0].message + found[0].evidence
    if counts[2] == 25:
        assert "timeout_s" in found[0].advice
    plain = diagnose.diagnose(diagnose.read_run(_tool_run(tmp_path / "plain", 0, 0, 0, 0)))
    assert "tools" not in plain.skipped and not [f for f in plain.findings if f.rule == "tools"]


def test_report_draws_the_tool_panel_only_for_a_tool_run(tmp_path):
    run = _tool_run(tmp_path / "tools", 40, 2, 0, 0)
    with MetricsWriter(run) as writer:  # the per-response tool metrics a tool run logs each step
        for step in range(9, 12):
            writer.log(step, {keys.TOOLS_CALLS_PER_RESPONSE: 0.9, keys.TOOLS_ERROR_RATE: 0.05,
                              keys.TOOLS_ACC_WITH: 0.6, keys.TOOLS_ACC_WITHOUT: 0.1, keys.TRAIN_LOSS: 0.1})
    assert report.main([str(run)]) == 0
    assert (run / "figures" / "tools.png").is_file()
    plain = _tool_run(tmp_path / "plain", 0, 0, 0, 0)
    assert report.main([str(plain)]) == 0
    assert not (plain / "figures" / "tools.png").exists()
