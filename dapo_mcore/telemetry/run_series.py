"""A run's logged series, read for the rules of ``diagnose``: the metrics and ledger records merged per step
(``load_run``), the series of one key (``Run``), a finding (``Finding``) and the small statistics the rules share.
No Megatron, torch or matplotlib import."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_mcore.telemetry import keys
from dapo_mcore.telemetry.jsonl import read_jsonl

METRICS_FILE = "metrics.jsonl"
LEDGER_FILE = "ledger.jsonl"
MIN_STEPS = 4
"""Fewer logged training steps than this: trend rules are skipped (one step says nothing about a trend)."""


def load_run(run_dir: Path) -> list[dict[str, Any]]:
    """Metrics and ledger records of a run merged per step, in step order."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists():
        raise FileNotFoundError(f"{metrics_path} does not exist; is {run_dir} a run directory?")
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_jsonl(metrics_path) + read_jsonl(run_dir / LEDGER_FILE):
        by_step.setdefault(record[keys.STEP], {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


@dataclass(frozen=True)
class Finding:
    """One thing a rule noticed."""

    rule: str
    level: str
    """``warn`` (likely holding the run back) or ``info``."""
    steps: str
    """The steps the evidence comes from, e.g. ``"61-80"``."""
    message: str
    evidence: str
    advice: str


class Run:
    """A run's records and resolved config, with the series helpers the rules share."""

    def __init__(self, records: Sequence[dict[str, Any]], config: dict[str, Any] | None = None):
        self.records = list(records)
        self.config = config or {}
        self.train_steps = [r[keys.STEP] for r in self.records if keys.TRAIN_LOSS in r or keys.TRAIN_LR in r]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records holding a finite ``key``."""
        pairs = [(r[keys.STEP], float(r[key])) for r in self.records
                 if isinstance(r.get(key), int | float) and math.isfinite(float(r[key]))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def has(self, key: str) -> bool:
        return any(key in r for r in self.records)

    def cfg(self, section: str, key: str) -> Any:
        value = self.config.get(section)
        return value.get(key) if isinstance(value, dict) else None

    def window(self, n: int) -> int:
        return max(3, n // 5)

    def start_end(self, key: str) -> tuple[float, float, str, str] | None:
        """Mean over the first and last windows, and their step ranges; None if too few points."""
        steps, values = self.series(key)
        if len(values) < MIN_STEPS:
            return None
        w = min(self.window(len(values)), len(values) // 2)
        return (_mean(values[:w]), _mean(values[-w:]), f"{steps[0]}-{steps[w - 1]}", f"{steps[-w]}-{steps[-1]}")

    def end_mean(self, key: str) -> float | None:
        steps, values = self.series(key)
        return _mean(values[-self.window(len(values)):]) if values else None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _first_below(steps: list[int], values: list[float], threshold: float, w: int) -> int | None:
    """First step at which the trailing mean over ``w`` steps is below ``threshold``."""
    for i in range(len(values)):
        lo = max(0, i - w + 1)
        if _mean(values[lo:i + 1]) < threshold:
            return steps[i]
    return None


def _heldout(run: Run) -> tuple[list[int], list[float]]:
    return run.series(keys.EVAL_AVG_AT_K)


def _k(run: Run) -> str:
    _, ks = run.series(keys.EVAL_K)
    return f"avg@{int(ks[-1])}" if ks else "avg@k"
