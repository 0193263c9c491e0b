"""Prompt history: skip prompts that carried no signal on their last visits (GRESO-like selective rollouts).

A group whose G responses are all right (or all wrong) has zero advantage: DAPO's dynamic sampling throws it
away after paying for its generation. Such prompts tend to stay that way for a while (GRESO, arXiv 2506.02177:
zero-variance prompts have a high chance of staying zero-variance on the next epoch), so the sampler can skip
them *before* generating, at no token cost.

Per prompt index the history keeps ``streak`` (consecutive visits with a uniform outcome), ``skips``
(consecutive skips since the last visit) and ``decisions`` (skip draws made, which seeds the next draw). The
skip probability of a prompt is::

    p = min(max_skip_prob, 1 - (1 - skip_prob) ** streak) * decay ** skips      (0 when streak = 0)

so it grows with repeated uniform visits, is capped (every prompt keeps at least ``1 - max_skip_prob`` chance
to be generated: exploration) and decays back each time the prompt is skipped, so no prompt is dropped forever.
Each draw uses its own ``random.Random`` seeded by ``(seed, index, decisions)``: the decisions are a pure function
of the history, identical on every rank and across a resume (``state_dict`` is plain JSON).
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["PromptHistory", "skip_probability"]

_STATE_VERSION = 1


def skip_probability(streak: int, skips: int, skip_prob: float, max_skip_prob: float, decay: float) -> float:
    """The skip probability of a prompt (see the module docstring)."""
    if streak <= 0:
        return 0.0
    return min(max_skip_prob, 1.0 - (1.0 - skip_prob) ** streak) * decay ** skips


class PromptHistory:
    """Visit outcomes and skip decisions per prompt index (see module docstring)."""

    def __init__(self, seed: int, skip_prob: float, max_skip_prob: float, decay: float) -> None:
        if not 0.0 < skip_prob <= 1.0 or not 0.0 <= max_skip_prob < 1.0 or not 0.0 <= decay <= 1.0:
            raise ValueError(f"skip_prob={skip_prob} must be in (0, 1], max_skip_prob={max_skip_prob} in [0, 1), "
                             f"decay={decay} in [0, 1]")
        self.seed, self.skip_prob, self.max_skip_prob, self.decay = seed, skip_prob, max_skip_prob, decay
        self.entries: dict[int, list[int]] = {}
        """index -> [streak, skips, decisions]"""
        self.skipped_total = 0
        """Skip decisions taken since the run began (logged as ``sampling/history_skipped_total``)."""

    def probability(self, index: int) -> float:
        """Current skip probability of prompt ``index``."""
        streak, skips, _ = self.entries.get(index, (0, 0, 0))
        return skip_probability(streak, skips, self.skip_prob, self.max_skip_prob, self.decay)

    def should_skip(self, index: int) -> bool:
        """Draw whether to skip prompt ``index`` now; a skip is remembered (its probability decays)."""
        p = self.probability(index)
        if p <= 0.0:
            return False
        entry = self.entries[index]
        entry[2] += 1
        skip = random.Random(f"prompt-history:{self.seed}:{index}:{entry[2]}").random() < p
        if skip:
            entry[1] += 1
            self.skipped_total += 1
        return skip

    def record(self, index: int, num_correct: int, group_size: int) -> None:
        """A visit of prompt ``index`` with ``num_correct`` of ``group_size`` responses right."""
        entry = self.entries.setdefault(index, [0, 0, 0])
        entry[0] = entry[0] + 1 if num_correct in (0, group_size) else 0
        entry[1] = 0

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "seed": self.seed, "skipped_total": self.skipped_total,
                "entries": {str(i): list(e) for i, e in sorted(self.entries.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"prompt history state version {state['version']} is not {_STATE_VERSION}")
        if state["seed"] != self.seed:
            raise ValueError(f"prompt history has seed={state['seed']} but this run has {self.seed}; resume with "
                             "the same train.seed")
        self.skipped_total = int(state["skipped_total"])
        self.entries = {int(i): [int(x) for x in e] for i, e in state["entries"].items()}
