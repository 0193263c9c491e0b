"""The reward audit: honest answers pay, blind shortcuts do not, and the shortcut detector fires when it should."""

from __future__ import annotations

import pytest

from dapo_mcore.reward import audit
from dapo_mcore.reward.result import RewardResult

pytestmark = pytest.mark.unit


def rates(rows):
    return {r.probe.name: (r.int_rate, r.latex_rate, r.distinct_paid) for r in rows}


def test_audit_results():
    got = rates(audit.run_audit(num=40, seed=1))
    assert got["honest: Answer: <gt>"][:2] == (1.0, 1.0)
    assert got["honest wrong: Answer: <wrong>"][:2] == (0.0, 0.0)
    assert got["Answer lines <gt> then <wrong>"][:2] == (0.0, 0.0)
    assert got["**Answer:** <gt> (markdown label)"][:2] == (0.0, 0.0)
    assert got["Answer: <gt> then 400 chars of text"][:2] == (0.0, 0.0)
    blind = [v for k, v in got.items() if k in {p.name for p in audit.PROBES if p.kind == "blind"}]
    assert blind and all(distinct <= 1 for _, _, distinct in blind)


def test_main_passes_and_prints(capsys):
    assert audit.main(["--num-gts", "20", "--markdown", "--fail-on-shortcut"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| probe |") and "`Answer: 0`" in out


def test_detector_fires_on_a_lenient_verifier(capsys):
    def substring_verifier(responses, gts):  # a hackable verifier: pays if gt appears anywhere
        out = []
        for response, gt in zip(responses, gts, strict=True):
            text = response.decode("utf-8", "replace") if isinstance(response, bytes) else response
            out.append(RewardResult(1.0 if gt in text else -1.0, gt in text, None))
        return out

    rows = audit.run_audit(num=30, seed=0, score=substring_verifier)
    assert audit.verdict("substring", rows).shortcuts


def test_tables_carry_a_legend():
    """The legend under the table says what int gt / latex gt / distinct and each kind mean, under the table."""
    from dapo_mcore.reward.audit import LEGEND, render

    text = render([], markdown=False)
    assert text.endswith(LEGEND) and "distinct: how many" in LEGEND and all(k in LEGEND for k in
                                                                            ("format", "hedge", "window", "blind"))
