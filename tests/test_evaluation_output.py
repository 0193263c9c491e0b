"""``dapo-mcore eval``'s output: counts print as integers, scores to 4 places; --json one object."""

import json

import pytest

from dapo_mcore.telemetry.evaluation import format_scores, summarize

pytestmark = pytest.mark.unit


def test_counts_are_integers_and_json_is_one_object():
    result = summarize([[True, False], [False, False]], [["1", "2"], [None, "3"]], [[True, False], [False, False]],
                       [[3, 4], [5, 6]])
    text = format_scores(result.as_metrics())
    assert "eval/k: 2\n" in text and "eval/problems: 2\n" in text and "eval/avg_at_k: 0.2500\n" in text
    data = json.loads(format_scores(result.as_metrics(), as_json=True))
    assert data["eval/k"] == 2 and isinstance(data["eval/problems"], int) and data["eval/pass_at_k"] == 0.5
