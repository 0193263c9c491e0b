"""Held-out accuracy from k samples per problem: avg@k, pass@k and maj@k.

avg@k is the paper's metric (AIME avg@32): the mean correctness over all k samples of all problems.
pass@k: a problem counts if any of its k samples is correct. maj@k: a problem counts if the most frequent
extracted answer among its k samples (ties broken by first occurrence) is correct; samples without an extracted
answer do not vote.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvalResult:
    """Aggregate held-out scores over ``problems`` problems with ``k`` samples each."""

    avg_at_k: float
    pass_at_k: float
    maj_at_k: float
    k: int
    problems: int
    mean_response_len: float

    def as_metrics(self) -> dict[str, float]:
        from dapo_mcore.telemetry import keys

        return {keys.EVAL_AVG_AT_K: self.avg_at_k, keys.EVAL_PASS_AT_K: self.pass_at_k,
                keys.EVAL_MAJ_AT_K: self.maj_at_k, keys.EVAL_K: float(self.k),
                "eval/problems": float(self.problems), "eval/resp_len_mean": self.mean_response_len}


COUNT_KEYS = ("eval/k", "eval/problems")
"""Scores that are counts: printed as integers."""


def eval_after(cfg: Any, step: int, fresh_start: bool) -> bool:
    """Whether a run evaluates the policy after ``step`` steps: before the first step of a fresh start
    (``eval.at_start``), every ``eval.every`` steps, and after the last."""
    if step == 0:
        return fresh_start and cfg.eval.at_start and cfg.train.steps > 0
    return bool(cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.train.steps


def format_scores(metrics: dict[str, float], as_json: bool = False) -> str:
    """``dapo-mcore eval``'s output: ``key: value`` lines (counts as integers, scores to 4 places) or one JSON object."""
    values = {k: int(v) if k in COUNT_KEYS else float(v) for k, v in metrics.items()}
    if as_json:
        import json

        return json.dumps(values) + "\n"
    return "".join(f"{k}: {v}\n" if isinstance(v, int) else f"{k}: {v:.4f}\n" for k, v in values.items())


def summarize(acc: Sequence[Sequence[bool]], preds: Sequence[Sequence[str | None]],
              correct_pred: Sequence[Sequence[bool]], lengths: Sequence[Sequence[int]]) -> EvalResult:
    """Scores from per-problem lists of k sample outcomes.

    Args:
        acc: per problem, per sample: was the sample judged correct.
        preds: per problem, per sample: the normalized extracted answer (None when nothing was extracted).
        correct_pred: per problem, per sample: is that normalized answer the correct one (aligned with ``preds``).
        lengths: per problem, per sample: response length in tokens.
    """
    if not acc:
        raise ValueError("no evaluation problems: the held-out set is empty")
    k = len(acc[0])
    if any(len(a) != k for a in acc):
        raise ValueError("every problem needs the same number of samples k")
    n = len(acc)
    avg = sum(sum(map(bool, a)) for a in acc) / (n * k)
    passed = sum(any(a) for a in acc) / n
    maj = 0
    for p_list, c_list in zip(preds, correct_pred, strict=True):
        votes = Counter(p for p in p_list if p is not None)
        if not votes:
            continue
        top = max(votes.values())
        winner = next(p for p in p_list if p is not None and votes[p] == top)
        maj += int(next(c for p, c in zip(p_list, c_list, strict=True) if p == winner))
    mean_len = sum(sum(lens) for lens in lengths) / (n * k)
    return EvalResult(avg, passed, maj / n, k, n, mean_len)
