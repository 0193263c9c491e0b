"""Staleness histogram: how many trained tokens each policy-version lag holds (``staleness/tokens_lag_<k>``).

A trained token's lag is the number of policy versions between the policy that sampled it and the one that trains on
it (each token carries the version that produced it, ``Response.versions``): 0 in the synchronous loop, up to
``rollout.pipeline.max_staleness`` in async mode (the engines run that many batches ahead; one less with partial
rollouts, whose continued prefixes are one version older). Logged per step whenever a run can train on stale tokens (async mode or partial
rollouts), summed over a window by ``dapo-mcore profile`` and drawn per step by ``dapo-mcore report``
(``staleness.png``). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["PREFIX", "histogram", "metrics", "totals", "describe"]

PREFIX = "staleness/tokens_lag_"


def histogram(pairs: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Tokens per lag from ``(lag, tokens)`` pairs (one or more per response); lags with no token are left out."""
    out: dict[int, int] = {}
    for lag, count in pairs:
        if lag < 0 or count < 0:
            raise ValueError(f"lag {lag} with {count} tokens: both must be >= 0")
        if count:
            out[lag] = out.get(lag, 0) + count
    return dict(sorted(out.items()))


def metrics(hist: dict[int, int], max_lag: int) -> dict[str, float]:
    """One key per lag 0..``max_lag`` (zeros included, so every step's line has the same keys)."""
    extra = [lag for lag in hist if lag > max_lag]
    if extra:
        raise ValueError(f"tokens at lag {extra} exceed the bound {max_lag}")
    return {f"{PREFIX}{lag}": float(hist.get(lag, 0)) for lag in range(max_lag + 1)}


def totals(records: Sequence[dict[str, Any]]) -> dict[int, float]:
    """The window's tokens per lag (summed over its steps); empty when no step logged the histogram."""
    out: dict[int, float] = {}
    for r in records:
        for key, value in r.items():
            if key.startswith(PREFIX):
                lag = int(key[len(PREFIX):])
                out[lag] = out.get(lag, 0.0) + float(value)
    return dict(sorted(out.items()))


def describe(tot: dict[int, float]) -> str:
    """``lag 0: 1,200 (75.0%), lag 1: 400 (25.0%)``."""
    whole = sum(tot.values())
    return ", ".join(f"lag {lag}: {n:,.0f} ({100 * n / whole if whole else 0.0:.1f}%)" for lag, n in tot.items())
