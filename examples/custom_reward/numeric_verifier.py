"""An example of your own verifier, loaded by import path: ``reward.name=numeric_verifier:score``.

Pays +1 when every ``Answer:`` line holds the same single number, equal to the ground truth within 1e-6
(so ``0.5`` matches ``1/2``), and refuses anything that names several numbers. It returns a bool; the trainer
maps True/False to +1/-1 (return a ``dapo_mcore.reward.RewardResult`` to set the score and a reason yourself).

Use it (from the repository root; the module must be importable, hence PYTHONPATH):

    PYTHONPATH=examples/custom_reward dapo-mcore audit-reward --reward numeric_verifier:score \\
        --probes examples/custom_reward/probes.jsonl --fail-on-shortcut --fail-on-hedge
    PYTHONPATH=examples/custom_reward dapo-mcore train examples/tiny_cpu.yaml \\
        reward.name=numeric_verifier:score reward.workers=2 run.dir=runs/tiny_numeric_reward

With ``reward.workers > 0`` it runs in the same isolated worker pool as the built-in verifiers, with the
``reward.timeout_s`` limit per answer. Keep it a module-level function of plain inputs (no eval of model text).
"""

from __future__ import annotations

import re
from fractions import Fraction

_ANSWER = re.compile(r"Answer\s*:\s*(.*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _value(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def score(response: str | bytes, ground_truth: str) -> bool:
    """True when the final answer is exactly one number equal to the ground truth."""
    if isinstance(response, bytes):
        response = response.decode("utf-8", errors="replace")
    lines = _ANSWER.findall(response[-score.tail_chars:])
    if not lines:
        return False
    values = set()
    for line in lines:  # every Answer: line must name the same single number
        numbers = _NUMBER.findall(line.replace(",", ""))
        if len(numbers) != 1:
            return False
        values.add(_value(numbers[0]))
    truth = _value(ground_truth.strip())
    if len(values) != 1 or truth is None or None in values:
        return False
    return abs(values.pop() - truth) <= Fraction(1, 10**6)


score.tail_chars = 300  # the function reads only this many final characters: the trainer may slice before sending
