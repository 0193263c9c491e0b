"""Staleness histogram (trained tokens by policy-version lag): counts, metric keys, profile and report."""

from __future__ import annotations

import pytest
from rich.console import Console

from dapo_mcore.telemetry import keys, profile, staleness
from dapo_mcore.telemetry.report import staleness_figure

pytestmark = pytest.mark.unit


def test_histogram_sums_tokens_per_lag_and_drops_empty_lags():
    # two async responses: 7 fresh tokens (lag 1) + 3 continued-prefix tokens (lag 2); 5 fresh, none stale
    assert staleness.histogram([(1, 7), (2, 3), (1, 5), (2, 0)]) == {1: 12, 2: 3}
    with pytest.raises(ValueError, match="must be >= 0"):
        staleness.histogram([(-1, 3)])


def test_metrics_have_one_key_per_lag_up_to_the_bound_and_refuse_beyond():
    assert staleness.metrics({1: 12, 2: 3}, 2) == {"staleness/tokens_lag_0": 0.0, "staleness/tokens_lag_1": 12.0,
                                                    "staleness/tokens_lag_2": 3.0}
    with pytest.raises(ValueError, match=r"lag \[3\] exceed the bound 2"):
        staleness.metrics({3: 1}, 2)


def _rows():
    return [{keys.STEP: s, keys.TIME_STEP: 1.0, **staleness.metrics({0: 100 - 10 * s, 1: 10 * s}, 1)}
            for s in range(1, 4)]


def test_profile_totals_the_window_and_prints_the_table():
    summary = profile.summarize(_rows())
    assert summary.staleness == {0: 240.0, 1: 60.0}
    console = Console(record=True, width=120)
    profile.render(summary, console, "run")
    text = console.export_text()
    assert "Staleness" in text and "80.0%" in text and "20.0%" in text
    assert profile.summarize([{keys.STEP: 1, keys.TIME_STEP: 1.0}]).staleness == {}
    assert staleness.describe(summary.staleness) == "lag 0: 240 (80.0%), lag 1: 60 (20.0%)"


def test_report_draws_the_staleness_figure_only_when_logged(tmp_path):
    assert staleness_figure([{keys.STEP: 1, keys.TIME_STEP: 1.0}], tmp_path) is None
    path = staleness_figure(_rows(), tmp_path)
    assert path == tmp_path / "staleness.png" and path.stat().st_size > 0
