"""``dapo-mcore profile RUN_DIR``: where a run's time and tokens went, as rich tables.

Reads ``metrics.jsonl`` and ``ledger.jsonl`` (merged per step, see ``report.load_run``): the share
of step wall time per phase and seconds per step, throughput and MFU when ``perf/*`` was logged,
and generated tokens kept vs rejected by dynamic sampling.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dapo_mcore.telemetry import keys, lanes, staleness
from dapo_mcore.telemetry.report import load_run, phase_seconds

PERF_KEYS: tuple[tuple[str, str, bool], ...] = (
    # key, label (what is counted, over which time), shown as percent
    (keys.PERF_TOKENS_PER_S_PER_DEVICE, "generated tokens / s / device, over the whole step", False),
    ("perf/decode_tokens_per_s_per_device", "generated tokens / s / device, over generate time", False),
    ("perf/train_tokens_per_s_per_device", "trained tokens (prompt + response) / s / device, over train time", False),
    ("perf/logprob_tokens_per_s_per_device", "log-prob tokens (prompt + response) / s / device, over old_logprobs "
                                             "time", False),
    (keys.PERF_MFU_TRAIN, "MFU, train", True),
    (keys.PERF_MFU_LOGPROB, "MFU, old log-probs", True),
)
TOKEN_KEYS: tuple[tuple[str, str], ...] = (
    ("tokens_generated_kept", "generated tokens, kept (trained on)"),
    ("tokens_generated_filtered", "generated tokens, rejected by dynamic sampling (groups not mixed)"),
    ("tokens_generated_surplus", "generated tokens, surplus groups (the step was already full)"),
    ("tokens_generated_aborted", "generated tokens, aborted in flight"),
    ("tokens_generated_rejected", "generated tokens, not kept (filtered + surplus)"),
    ("tokens_generated", "generated tokens, all"),
    ("rollouts_kept", "rollouts, kept"),
    ("rollouts_rejected", "rollouts, not kept (filtered + surplus)"),
    ("tokens_trained", "tokens trained (prompt + response, every epoch)"),
)
"""Kept + filtered + surplus + aborted = all generated tokens (``tokens_generated_rejected`` is filtered + surplus)."""
TOOL_KEYS: tuple[tuple[str, str], ...] = (
    ("tool_calls", "tool calls"),
    ("tool_errors", "tool calls that errored (any output but a clean one)"),
    ("tool_timeouts", "tool calls stopped at the timeout"),
    ("tool_sandbox_failures", "tool calls whose sandbox did not start"),
    ("tool_seconds", "tool seconds (calls summed; they overlap decoding)"),
)
"""Multi-turn tool use: the ledger's tool counters, shown when the window made a call."""


@dataclass
class PhaseRow:
    phase: str
    total_s: float
    share: float
    per_step_s: float
    last_s: float


@dataclass
class ProfileSummary:
    """Numbers behind the tables; ``tokens`` sums the per-step ``cost/step/*`` counters of the window."""

    steps: list[int]
    """The training steps of the window (the step-0 base evaluation is not one)."""
    phases: list[PhaseRow] = field(default_factory=list)
    base_eval_s: float | None = None
    """Seconds of the step-0 base evaluation (before the first step: in no step's wall time), when in the window."""
    perf: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (mean, last)
    tokens: dict[str, float] = field(default_factory=dict)
    tools: dict[str, float] = field(default_factory=dict)
    """Window totals of the ledger's tool counters (multi-turn tool use), when any call was made."""
    pipeline: dict[str, float] = field(default_factory=dict)
    """Async mode: the window's means of ``async/*`` (lag, waits on both sides, overlap)."""
    engine_lane: list[PhaseRow] = field(default_factory=list)
    """Async mode: the engines' seconds per batch (generate, score, wait for weights, receive them, eval)."""
    staleness: dict[int, float] = field(default_factory=dict)
    """Trained tokens per policy-version lag over the window (async mode, partial rollouts; ``telemetry.staleness``)."""
    skipped: list[str] = field(default_factory=list)
    """Phases a mode skips (bypass: old_logprobs), shown as skipped rather than missing."""


def summarize(records: Sequence[dict[str, Any]]) -> ProfileSummary:
    """Per-phase time shares, mean/last perf numbers and token totals over ``records``."""
    # The step-0 base evaluation is no training step: its time is shown apart, and per-step means leave it out.
    base = [r for r in records if r[keys.STEP] == 0 and keys.TIME_STEP not in r]
    records = [r for r in records if not (r[keys.STEP] == 0 and keys.TIME_STEP not in r)]
    summary = ProfileSummary(steps=[r[keys.STEP] for r in records])
    if base and keys.time_key("eval") in base[0]:
        summary.base_eval_s = float(base[0][keys.time_key("eval")])
    if not records:
        return summary
    phases = phase_seconds(records)
    inner = {p: s for p, s in phases.items() if p != keys.STEP_PHASE}
    if keys.STEP_PHASE in phases:
        wall = phases[keys.STEP_PHASE]
        untimed = wall - sum(inner.values()) if inner else wall
        inner = {**inner, "other (untimed)": untimed}
    denom = float(sum(s.sum() for s in inner.values()))
    names = lanes.TRAINER_LABELS if lanes.is_async(records) else {}
    for phase, s in inner.items():
        summary.phases.append(PhaseRow(names.get(phase, phase), float(s.sum()),
                                       float(s.sum()) / denom if denom > 0 else 0.0, float(s.mean()), float(s[-1])))
    if keys.STEP_PHASE in phases:
        s = phases[keys.STEP_PHASE]
        summary.phases.append(PhaseRow("step (wall)", float(s.sum()), 1.0, float(s.mean()), float(s[-1])))
    if any(keys.CORR_BYPASS in r for r in records) and "old_logprobs" not in phases:
        summary.skipped.append("old_logprobs")
    for key, _, _ in PERF_KEYS:
        values = [float(r[key]) for r in records if key in r]
        if values:
            summary.perf[key] = (sum(values) / len(values), values[-1])
    for name, _ in TOKEN_KEYS:
        key = keys.cost_key(name, cumulative=False)
        if any(key in r for r in records):
            summary.tokens[name] = float(sum(r.get(key, 0) for r in records))
    totals = {name: float(sum(r.get(keys.cost_key(name, cumulative=False), 0) for r in records))
              for name, _ in TOOL_KEYS}
    if totals["tool_calls"] > 0:
        summary.tools = totals
    summary.engine_lane = _engine_lane(records)
    summary.staleness = staleness.totals(records)
    for key in sorted({k for r in records for k in r if k.startswith("async/")}):
        values = [float(r[key]) for r in records if key in r]
        summary.pipeline[key.removeprefix("async/")] = sum(values) / len(values)
    if "tokens_generated_rejected" in summary.tokens and "tokens_generated_surplus" in summary.tokens:
        summary.tokens["tokens_generated_filtered"] = (summary.tokens["tokens_generated_rejected"]
                                                       - summary.tokens["tokens_generated_surplus"])
    return summary


def _engine_lane(records: Sequence[dict[str, Any]]) -> list[PhaseRow]:
    """The engines' seconds per batch (``telemetry.lanes``), shares of their sum; eval from the trainer's wait for it
    when the engines do not report their own."""
    if not lanes.is_async(records):
        return []
    cols = {label: [float(r.get(key) or 0.0) for r in records] for key, label in lanes.ENGINE_SECONDS
            if any(key in r for r in records)}
    if "eval" not in cols and any(keys.TIME_EVAL in r for r in records):
        cols["eval"] = [float(r.get(keys.TIME_EVAL) or 0.0) for r in records]
    total = sum(sum(v) for v in cols.values())
    return [PhaseRow(label, sum(v), sum(v) / total if total > 0 else 0.0, sum(v) / len(v), v[-1])
            for label, v in cols.items()]


def _share(tokens: dict[str, float], name: str) -> str:
    """``name`` as a share of everything generated of its kind ("" for tokens trained)."""
    if name == "tokens_generated_rejected" and "tokens_generated_filtered" in tokens:
        return "= filtered + surplus"
    if name.startswith("tokens_generated"):
        total = tokens.get("tokens_generated", 0.0)
    elif name.startswith("rollouts_"):
        total = tokens.get("rollouts_kept", 0.0) + tokens.get("rollouts_rejected", 0.0)
    else:
        return ""
    return f"{100 * tokens[name] / total:.1f}%" if total > 0 else ""


def render(summary: ProfileSummary, console: Console, run_name: str) -> None:
    """Print the three tables (time, throughput, tokens) of ``summary``."""
    if not summary.steps:
        console.print(f"{run_name}: no steps logged")
        return
    console.print(f"[bold]{run_name}[/bold]: {len(summary.steps)} steps ({summary.steps[0]}..{summary.steps[-1]})")
    time_table = Table(title="Where time went" + (" (trainer lane)" if summary.engine_lane else ""))
    for col in ("phase", "total s", "share", "mean s/step", "last s"):
        time_table.add_column(col, justify="left" if col == "phase" else "right")
    for row in summary.phases:
        time_table.add_row(row.phase, f"{row.total_s:.2f}", f"{100 * row.share:.1f}%",
                           f"{row.per_step_s:.3f}", f"{row.last_s:.3f}")
    for phase in summary.skipped:
        time_table.add_row(phase, "skipped", "", "", "", end_section=False)
    console.print(time_table if summary.phases else "no time/* metrics logged")
    if "old_logprobs" in summary.skipped:
        console.print("old_logprobs: skipped (bypass mode, algo.rollout_correction: pi_old := the engine's log-probs)")
    if summary.base_eval_s is not None:
        console.print(f"base evaluation (step 0, before the first step; not in the table): "
                      f"{summary.base_eval_s:.2f} s")
    perf_table = Table(title="Throughput")
    for col in ("metric", "mean", "last"):
        perf_table.add_column(col, justify="left" if col == "metric" else "right")
    for key, label, percent in PERF_KEYS:
        if key in summary.perf:
            mean, last = summary.perf[key]
            fmt = (lambda v: f"{100 * v:.1f}%") if percent else (lambda v: f"{v:,.1f}")
            perf_table.add_row(label, fmt(mean), fmt(last))
        else:
            perf_table.add_row(label, "not logged", "")
    console.print(perf_table)
    if summary.tokens:
        tok_table = Table(title="Generation spend (window total)")
        tok_table.add_column("counter")
        tok_table.add_column("total", justify="right")
        tok_table.add_column("share of generated", justify="right")
        for name, label in TOKEN_KEYS:
            if name in summary.tokens and (name != "tokens_generated_rejected" or summary.tokens[name]):
                share = _share(summary.tokens, name)
                tok_table.add_row(label, f"{summary.tokens[name]:,.0f}", share)
        console.print(tok_table)
    else:
        console.print("no cost/* token counters logged")
    if summary.tools:
        _render_tools(summary.tools, console)
    if summary.engine_lane:
        engines = Table(title="Engine lane (async: seconds per batch, while the trainer trains)")
        for col in ("phase", "total s", "share", "mean s/step", "last s"):
            engines.add_column(col, justify="left" if col == "phase" else "right")
        for row in summary.engine_lane:
            engines.add_row(row.phase, f"{row.total_s:.2f}", f"{100 * row.share:.1f}%", f"{row.per_step_s:.3f}",
                            f"{row.last_s:.3f}")
        console.print(engines)
    if summary.staleness:
        whole = sum(summary.staleness.values())
        stale = Table(title="Staleness (trained tokens by policy-version lag, window total)")
        for col in ("lag", "tokens", "share"):
            stale.add_column(col, justify="right")
        for lag, n in summary.staleness.items():
            stale.add_row(str(lag), f"{n:,.0f}", f"{100 * n / whole if whole else 0.0:.1f}%")
        console.print(stale)
    if summary.pipeline:
        pipe = Table(title="Async pipeline (means per step)")
        pipe.add_column("metric")
        pipe.add_column("mean", justify="right")
        for name, value in summary.pipeline.items():
            pipe.add_row(name, f"{value:.3f}")
        console.print(pipe)


def _render_tools(tools: dict[str, float], console: Console) -> None:
    table = Table(title="Tool calls (window total)")
    table.add_column("counter")
    table.add_column("total", justify="right")
    table.add_column("share of calls", justify="right")
    calls = tools["tool_calls"]
    for name, label in TOOL_KEYS:
        value = tools[name]
        if name == "tool_seconds":
            table.add_row(label, f"{value:,.2f}", f"{value / calls:.3f} s/call")
        else:
            table.add_row(label, f"{value:,.0f}", "" if name == "tool_calls" else f"{100 * value / calls:.1f}%")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    """``dapo-mcore profile RUN_DIR [--last N]``: text summary of where time and tokens went."""
    parser = argparse.ArgumentParser(prog="dapo-mcore profile", description="Summarize a run's time and cost.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--last", type=int, default=None, help="only the last N steps (skip warm-up)")
    args = parser.parse_args(argv)
    if args.last is not None and args.last < 1:
        parser.error(f"--last {args.last}: pass a number of steps >= 1")
    records = load_run(args.run_dir)  # a missing run is an OSError: the CLI reports it on stderr and exits 2
    if args.last is not None:
        records = records[-args.last:]
    render(summarize(records), Console(), args.run_dir.resolve().name)
    return 0
