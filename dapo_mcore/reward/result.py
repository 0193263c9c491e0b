"""The verdict on one response (``RewardResult``) and what a reward function may return, read as one (``as_result``):
the floor of ``reward/`` that the verifier, the registry, the guard and the pool all build on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RewardResult:
    """The verdict on one response."""

    score: float
    """+1.0 correct, -1.0 otherwise."""
    acc: bool
    """Correct or not (dynamic sampling filters on this, not on the shaped reward)."""
    pred: str | None
    """The normalized prediction; None when nothing was extracted."""
    reason: str | None = None
    """Why there is no prediction (no answer line, worker timeout/crash, ...); None for a plain comparison."""
    failed: bool = False
    """The reward function failed on this answer (raised, timed out, crashed, returned no verdict): scored wrong,
    and counted by the run's circuit breaker (reward.guard)."""


def failure(reason: str) -> RewardResult:
    """The verdict for an answer whose reward failed: wrong, with the reason, marked as a failure."""
    return RewardResult(-1.0, False, None, reason, failed=True)


def as_result(out: Any) -> RewardResult:
    """A reward function's return value as a RewardResult: a RewardResult, a bool (+1/-1) or a real number (the
    score; correct when > 0), numpy and torch scalars included (np.bool_, np.float64, a 0-d tensor). Raises
    TypeError for anything else (a string, a list, None)."""
    if type(out) is RewardResult and type(out.score) is float and type(out.acc) is bool:
        return out  # the registered rewards' verdicts: nothing to convert
    out = _scalar(out)
    if isinstance(out, RewardResult):
        score, acc = _scalar(out.score), _scalar(out.acc)
        if not isinstance(acc, bool) or not isinstance(score, int | float) or isinstance(score, bool):
            raise TypeError(f"returned RewardResult(score={score!r}, acc={acc!r}); score must be a number, acc a bool")
        return RewardResult(float(score), acc, out.pred, out.reason, out.failed)
    if isinstance(out, bool):
        return RewardResult(1.0 if out else -1.0, out, None)
    if isinstance(out, int | float):
        return RewardResult(float(out), float(out) > 0, None)
    raise TypeError(f"returned {type(out).__name__}; return a RewardResult, a bool or a number")


def _scalar(value: Any) -> Any:
    """numpy / torch scalars (0-d) as Python values; anything else unchanged."""
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)) \
            and not isinstance(value, bool | int | float):
        return value.item()
    return value
