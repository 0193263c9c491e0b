"""What keeps a bad reward function from hanging, poisoning or silently starving a run.

- Time limits in every mode: the pool (``reward.pool``) kills a worker stuck past ``reward.timeout_s``; in process
  (``reward.workers=0``, registered rewards only: a custom ``package.module:function`` always runs in the pool,
  where a hang or an ``os._exit`` is bounded) an interval timer (SIGALRM) interrupts an answer that has been
  running for one to two ``timeout_s``. Either way the answer is scored wrong with the reason, as a failure.
- A circuit breaker (``FailureBreaker``): a failure is an answer whose reward raised, timed out, crashed its
  worker or returned something that is not a verdict (a string). Once at least half of the window has been seen,
  a share of failures of ``reward.max_failure_frac`` or more among the last ``reward.failure_window`` answers
  stops the run in one line quoting the reward's first error, instead of 30 batches of "dynamic sampling kept
  0/16 usable groups". The first failure is logged when it happens.
- Finite scores (``check_finite``): a NaN or infinite score stops the run at once, naming the reward and the
  answer, before it reaches an advantage.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from dapo_mcore.errors import NonFiniteError, UserError
from dapo_mcore.reward.result import RewardResult, as_result, failure

log = logging.getLogger(__name__)

MIN_SEEN_FRAC = 0.5
"""The breaker judges once it has seen at least this share of its window (a few early failures never trip it)."""


class RewardFailingError(UserError):
    """The reward function fails on too many answers: the run stops rather than train on nothing."""


class FailureBreaker:
    """Counts failed answers over a sliding window; ``record`` raises RewardFailingError when the share is too high."""

    def __init__(self, name: str, window: int, max_frac: float) -> None:
        self.name, self.window, self.max_frac = name, window, max_frac
        self._recent: deque[str | None] = deque(maxlen=window)
        self.first_error: str | None = None
        self.failures = 0

    def record(self, result: RewardResult) -> None:
        kind = _kind(result.reason) if result.failed else None
        self._recent.append(kind)
        if kind is None:
            return
        self.failures += 1
        if self.first_error is None:
            self.first_error = result.reason
            log.warning("reward %s failed on an answer: %s (scored wrong; the run stops if %.0f%% of the last %d "
                        "answers fail: reward.max_failure_frac, reward.failure_window)", self.name, result.reason,
                        100 * self.max_frac, self.window)
        seen = len(self._recent)
        failed = Counter(k for k in self._recent if k is not None)
        if seen >= MIN_SEEN_FRAC * self.window and sum(failed.values()) >= self.max_frac * seen:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(failed.items()))
            raise RewardFailingError(
                f"reward {self.name} failed on {sum(failed.values())} of the last {seen} answers ({kinds}); its first "
                f"error: {self.first_error}. Fix the reward function (check it with dapo-mcore audit-reward), or "
                "raise reward.timeout_s if it is only slow")


def _kind(reason: str | None) -> str:
    text = reason or ""
    if "timed out" in text:
        return "timed out"
    if "crashed" in text:
        return "crashed the worker"
    return "raised or returned no verdict"


def check_finite(name: str, results: Sequence[RewardResult], texts: Sequence[Any]) -> None:
    """Raise NonFiniteError naming the reward and the answer if any score is NaN or infinite."""
    for result, text in zip(results, texts, strict=True):
        if not math.isfinite(result.score):
            shown = text if isinstance(text, str) else bytes(text).decode("utf-8", "replace")
            shown = shown[-80:].replace("\n", "\\n")
            raise NonFiniteError(f"reward {name} returned score {result.score!r} for the answer ending {shown!r}; a "
                                 "reward must be a finite number: fix the reward function")


class _Timeout(BaseException):
    """Raised into a reward function that ran past its time (BaseException: a reward's `except Exception` cannot
    swallow it)."""


class InProcessScorer:
    """``reward.workers=0``: score in this process, each answer bounded by an interval timer (module docstring).

    Must run on the main thread (signals are delivered there); the trainer scores there.
    """

    def __init__(self, fn: Callable[..., Any], timeout_s: float, breaker: FailureBreaker | None = None) -> None:
        self.fn, self.timeout_s, self.breaker = fn, timeout_s, breaker
        self._current, self._at_last_tick, self._in_fn = -1, -2, False

    def __call__(self, texts: Sequence[Any], truths: Sequence[str]) -> list[RewardResult]:
        assert threading.current_thread() is threading.main_thread(), "in-process scoring runs on the main thread"
        previous = signal.signal(signal.SIGALRM, self._tick)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s, self.timeout_s)
        try:
            return [self._one(i, t, g) for i, (t, g) in enumerate(zip(texts, truths, strict=True))]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            self._current, self._at_last_tick = -1, -2

    def _one(self, i: int, text: Any, truth: str) -> RewardResult:
        self._current = i
        try:
            self._in_fn = True
            result = as_result(self.fn(text, truth))
            self._in_fn = False
        except _Timeout:
            result = failure(f"reward timed out after {self.timeout_s:g}s")
        except Exception as exc:  # a failing answer is scored wrong, with the reason recorded (and counted)
            result = failure(f"reward function raised {type(exc).__name__}: {exc}"[:300])
        finally:
            self._in_fn = False
        if self.breaker is not None:
            self.breaker.record(result)
        return result

    def _tick(self, signum: int, frame: Any) -> None:
        """Every ``timeout_s``: an answer that was already running at the previous tick has had its time."""
        if self._in_fn and self._current == self._at_last_tick:
            raise _Timeout()
        self._at_last_tick = self._current
