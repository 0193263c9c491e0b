"""A step's tool-use metrics from its generated responses (every rank holds all of them, so these are global)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dapo_mcore.rollout.protocol import Response
from dapo_mcore.telemetry import keys

__all__ = ["tool_metrics"]


def tool_metrics(groups: Iterable[tuple[Sequence[Response], Sequence[bool]]]) -> dict[str, float]:
    """``tools/*`` over ``(responses, acc)`` pairs (one per group): calls per response, the error rate of the calls
    (absent without a call), and the accuracy of the responses with and without a call (each absent when empty)."""
    calls = errors = n = 0
    right = {True: 0, False: 0}
    count = {True: 0, False: 0}
    for responses, acc in groups:
        for r, ok in zip(responses, acc, strict=True):
            n += 1
            calls += r.tool_calls
            errors += r.tool_errors
            used = r.tool_calls > 0
            count[used] += 1
            right[used] += int(bool(ok))
    if n == 0:
        return {}
    out = {keys.TOOLS_CALLS_PER_RESPONSE: calls / n}
    if calls:
        out[keys.TOOLS_ERROR_RATE] = errors / calls
    if count[True]:
        out[keys.TOOLS_ACC_WITH] = right[True] / count[True]
    if count[False]:
        out[keys.TOOLS_ACC_WITHOUT] = right[False] / count[False]
    return out
